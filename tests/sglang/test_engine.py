"""graphtrace in a real SGLang engine (CPU): the plugin in the scheduler process, the guard on
SGLang's own update entry points, and SGLang's answers (issue #41).

One engine for the whole module (an engine start is ~1-2 min on two shared cores). Every
test leaves it serving correct weights (mode ``refresh``, a correct update last), so their
order does not matter. The planted derived tensor (tests/sglang/plant.py) is ``weight_t`` on
every linear layer of SGLang's UnquantizedLinearMethod; the mode file says what SGLang's
``process_weights_after_loading`` does to it at the next update.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROMPT = [[1, 5, 6, 7]]
HOLDER = "model.layers.0.mlp.down_proj.weight_t"


@pytest.fixture(scope="module")
def served(work):
    import os

    import sglang

    import graphtrace.sglang as gs
    from graphtrace.vllm.tiny import make_tiny_llama

    mode = work / "plant-mode"
    mode.write_text("refresh")
    os.environ["GRAPHTRACE_TEST_PLANT"] = str(mode)
    model = make_tiny_llama(work / "model", tokenizer=True)
    with gs.trace_engine(work / "graphtrace") as st:
        engine = sglang.Engine(model_path=str(model), device="cpu",
                               attention_backend="torch_native", disable_cuda_graph=True,
                               mem_fraction_static=0.1, max_total_tokens=2048, dtype="float32",
                               skip_server_warmup=True, log_level="error", random_seed=0)
    try:
        yield Served(engine, st, mode, Path(model), work)
    finally:
        engine.shutdown()
        os.environ.pop("GRAPHTRACE_TEST_PLANT", None)


class Served:
    def __init__(self, engine, st, mode: Path, model: Path, work: Path):
        self.engine, self.st, self.mode, self.model, self.work = engine, st, mode, model, work
        self.seed = 0

    def generate(self) -> list[int]:
        out = self.engine.generate(input_ids=PROMPT, sampling_params=dict(
            temperature=0, max_new_tokens=4, ignore_eos=True))
        return out[0]["output_ids"]

    def new_weights(self) -> list:
        from graphtrace.vllm.tiny import checkpoint_weights, perturbed

        self.seed += 1
        return list(checkpoint_weights(self.model, perturbed(self.seed, 0.05)))

    def session_update(self, mode: str = "refresh") -> tuple[bool, str]:
        """SGLang's RL update: begin -> tensors -> end; the end's answer."""
        self.mode.write_text(mode)
        e = self.engine
        assert e.begin_weight_update()[0]
        assert e.update_weights_from_tensor(named_tensors=self.new_weights())[0]
        return tuple(e.end_weight_update()[:2])

    def checks(self) -> list[dict]:
        return self.st.checks()

    def settle(self) -> None:
        """After a refused request: SGLang finishes its abort in the scheduler's next rounds;
        an update whose cache flush finds it still queued answers success=False ("the cache
        was not flushed"). Wait until a flush succeeds (the engine is idle)."""
        import time

        for _ in range(50):
            if self.engine.flush_cache().success:
                return
            time.sleep(0.1)
        raise AssertionError("the engine did not become idle after a refused request")


def test_the_scheduler_traces_the_model_and_records_a_graph_per_decode_batch_size(served):
    tokens = served.generate()
    assert len(tokens) == 4
    folder = served.st.write_report(served.engine, "startup")
    from graphtrace.report import load_report

    report = load_report(folder)
    graphs = report.graphs
    assert list(graphs["label"]) == ["decode_bs1", "decode_bs2"]
    assert list(graphs["kind"]) == ["emulated", "emulated"] and (graphs["n_accesses"] > 0).all()
    assert report.meta["sglang"]["rank"] == 0
    assert served.checks() == []  # no update yet: nothing checked, nothing per forward


def test_a_clean_update_passes_with_one_check_before_the_next_forward(served):
    before = len(served.checks())
    assert served.session_update("refresh") == (True, "Success")
    checks = served.checks()[before:]
    assert [(c["trigger"], c["ok"]) for c in checks] == [("end_weight_update", True)]
    assert checks[0]["updates"] == ["begin_weight_update", "update_weights_from_tensor"]
    assert checks[0]["graphs"] == 2
    served.generate()
    served.generate()
    assert len(served.checks()) == before + 1  # serving runs no check


def test_a_rebound_holder_fails_the_update_refuses_serving_until_a_correct_one(served):
    before = len(served.checks())
    ok, message = served.session_update("rebind")
    assert not ok
    assert "graphtrace guard" in message and "end_weight_update" in message
    assert f"{HOLDER} [moved]" in message and "stale" in message

    with pytest.raises(Exception, match="graphtrace guard") as refused:
        served.generate()
    assert HOLDER in str(refused.value)

    # the diff through `graphtrace report`, from the scheduler's report folder
    folder = served.st.write_report(served.engine, "after_rebind")
    cli = subprocess.run([sys.executable, "-m", "graphtrace", "report", str(folder)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert HOLDER in cli.stdout and "stale" in cli.stdout

    served.settle()
    assert served.session_update("refresh") == (True, "Success")
    assert len(served.generate()) == 4
    checks = served.checks()[before:]
    assert [(c["trigger"], c["ok"]) for c in checks] == [
        ("end_weight_update", False), ("before_forward", False), ("end_weight_update", True)]
    assert HOLDER in checks[0]["owners"]


def test_a_derived_tensor_not_recomputed_is_unrefreshed(served):
    """SGLang writes the weights with param.data.copy_ (no version counter moves): lineage
    sees the writes, and the derived tensor that was not recomputed reads `unrefreshed`."""
    ok, message = served.session_update("keep")
    assert not ok and "unrefreshed" in message and HOLDER in message
    assert served.session_update("refresh") == (True, "Success")
    assert len(served.generate()) == 4


def test_update_weights_from_disk_is_one_update(served):
    from graphtrace.vllm.tiny import perturbed, write_changed_checkpoint

    before = len(served.checks())
    new = write_changed_checkpoint(served.model, served.work / "disk1", perturbed(7, 0.05))
    served.mode.write_text("rebind")
    answer = served.engine.update_weights_from_disk(str(new))
    assert not answer[0] and f"{HOLDER} [moved]" in answer[1]
    with pytest.raises(Exception, match="graphtrace guard"):
        served.generate()
    served.settle()
    served.mode.write_text("refresh")
    answer = served.engine.update_weights_from_disk(str(new))
    assert answer[0], answer
    assert len(served.generate()) == 4
    checks = served.checks()[before:]
    assert [(c["trigger"], c["ok"]) for c in checks] == [
        ("update_weights_from_disk", False), ("before_forward", False),
        ("update_weights_from_disk", True)]


def test_memory_release_and_resume_is_checked_on_resume(served):
    before = len(served.checks())
    served.engine.release_memory_occupation()
    served.engine.resume_memory_occupation()
    checks = served.checks()[before:]
    assert [(c["trigger"], c["ok"], c["updates"]) for c in checks] == [
        ("resume_memory_occupation", True, ["release_memory_occupation"])]
    assert len(served.generate()) == 4


def test_no_placeholder_kernel_was_called(served):
    """Last: the engine started, served and went through every update above."""
    import os

    log = Path(os.environ["GRAPHTRACE_SGL_KERNEL_LOG"])
    assert not log.exists() or not log.read_text().strip(), log.read_text()
