"""Ranks agree in a real tensor-parallel SGLang engine (tp_size=2, CPU, gloo): a stale holder
planted on rank 1 only makes every rank refuse, and the answer SGLang returns (rank 0's)
carries rank 1's problems (graphtrace/sglang/session.py `tp_ranks`: SGLang's own TP group).

Two settings make SGLang 0.5.23 start two CPU ranks on this one-NUMA-node host, stated: the
cores of each rank (``SGLANG_CPU_OMP_THREADS_BIND``, which SGLang asks for when ranks
outnumber NUMA nodes), and ``SGLANG_NCCL_SO_PATH`` pointing at no file, so that SGLang's NCCL
communicator disables itself as on a CPU build of torch (the CUDA build here ships
libnccl, and the communicator then asks for a CUDA device). One engine start (~1.5 min).
"""

from __future__ import annotations

import pytest

PROMPT = [[1, 5, 6, 7]]
HOLDER = "model.layers.0.mlp.down_proj.weight_t"
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}


@pytest.fixture(scope="module")
def tp2(work):
    import sglang

    import graphtrace.sglang as gs
    from graphtrace.vllm.tiny import make_tiny_llama

    mode = work / "plant-mode-tp2"
    mode.write_text("refresh")
    model = make_tiny_llama(work / "model-tp2", tokenizer=True)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**TP_ENV, "GRAPHTRACE_TEST_PLANT": str(mode)}.items():
            mp.setenv(key, value)
        with gs.trace_engine(work / "graphtrace-tp2") as st:
            engine = sglang.Engine(model_path=str(model), tp_size=2, device="cpu",
                                   attention_backend="torch_native", disable_cuda_graph=True,
                                   mem_fraction_static=0.1, max_total_tokens=2048,
                                   dtype="float32", skip_server_warmup=True, log_level="error",
                                   random_seed=0)
    try:
        yield engine, st, mode, model
    finally:
        engine.shutdown()


def _generate(engine) -> list[int]:
    out = engine.generate(input_ids=PROMPT, sampling_params=dict(
        temperature=0, max_new_tokens=4, ignore_eos=True))
    return out[0]["output_ids"]


def _update(engine, mode_file, mode: str, model, seed: int) -> tuple[bool, str]:
    from graphtrace.vllm.tiny import checkpoint_weights, perturbed

    mode_file.write_text(mode)
    assert engine.begin_weight_update()[0]
    assert engine.update_weights_from_tensor(
        named_tensors=list(checkpoint_weights(model, perturbed(seed, 0.05))))[0]
    return tuple(engine.end_weight_update()[:2])


def test_a_stale_holder_on_rank_1_only_makes_every_rank_refuse(tp2):
    import time

    engine, st, mode, model = tp2
    assert len(_generate(engine)) == 4
    assert _update(engine, mode, "refresh", model, 1) == (True, "Success")
    assert [c["ok"] for c in st.checks(0)] == [True] and [c["ok"] for c in st.checks(1)] == [True]

    ok, message = _update(engine, mode, "rebind@1", model, 2)  # rank 0's answer
    assert ok is False, message
    assert "problems in rank(s) 1 of 2" in message and "rank 1: " in message
    assert f"{HOLDER} [moved]" in message
    # each rank checked and refused; rank 0's own holder did not move
    zero, one = st.checks(0)[-1], st.checks(1)[-1]
    assert zero["ok"] and not one["ok"] and HOLDER in one["owners"]

    with pytest.raises(Exception, match="problems in rank\\(s\\) 1 of 2"):
        _generate(engine)  # every rank aborts the request (else their batches diverge)
    for _ in range(50):  # the aborted request leaves the scheduler's queue
        if engine.flush_cache().success:
            break
        time.sleep(0.1)

    assert _update(engine, mode, "refresh", model, 3) == (True, "Success")
    assert len(_generate(engine)) == 4
    assert st.checks(0)[-1]["ok"] and st.checks(1)[-1]["ok"]
