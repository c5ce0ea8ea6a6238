"""An RL client's weight update, as its source makes it, against the real SGLang engine under
graphtrace's guard (issue #41).

The client: AReaL, ``areal/engine/sglang_remote.py`` at commit
008603bd09f83f19ece2fefa510d08f01a63a38b (inclusionAI/AReaL), ``RemoteSGLangEngine
.update_weights`` for ``meta.type == "disk"``. For every server, in this order:

1. ``POST /pause_generation`` (no body: SGLang's default mode, ``abort``);
2. ``POST /update_weights_from_disk`` with ``model_path`` (and ``abort_all_request=True``, so
   spelt there; SGLang's field is ``abort_all_requests``, which later AReaL versions send);
3. ``POST /continue_generation`` (no body), when the update's future is done.

This driver is our own: it makes the same three requests, in the same order, through the
engine's tokenizer manager (the objects SGLang's HTTP handlers build from those bodies), with
``abort_all_requests=True``; then the client's next rollout is a greedy generate. The engine is
the adapter's CPU setup (torch_native attention, the placeholder sgl_kernel): SGLang captures
no graph there, graphtrace records emulated decode graphs where SGLang would.
"""

from __future__ import annotations

import pytest

PROMPT = [[1, 17, 45, 300, 12, 99, 7]]
NEW_TOKENS = 4


def areal_disk_update(engine, model_path: str):
    """AReaL's disk update sequence (module doc); SGLang's answer to the update."""
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        PauseGenerationReqInput,
        UpdateWeightFromDiskReqInput,
    )

    manager, loop = engine.tokenizer_manager, engine.loop
    loop.run_until_complete(manager.pause_generation(PauseGenerationReqInput()))
    answer = loop.run_until_complete(manager.update_weights_from_disk(
        UpdateWeightFromDiskReqInput(model_path=model_path, abort_all_requests=True), None))
    loop.run_until_complete(manager.continue_generation(ContinueGenerationReqInput()))
    return answer


def _greedy(folder) -> list[int]:
    import torch
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(PROMPT[0])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT[0]):]


@pytest.fixture(scope="module")
def areal(work):
    import sglang

    import graphtrace.sglang as gs
    from graphtrace.vllm.tiny import make_tiny_llama, perturbed, write_changed_checkpoint

    a = make_tiny_llama(work / "areal-A")
    b = write_changed_checkpoint(a, work / "areal-B", perturbed(seed=3))
    sampling = dict(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with gs.trace_engine(work / "graphtrace-areal", guard="raise") as st:
        engine = sglang.Engine(model_path=str(a), device="cpu", attention_backend="torch_native",
                               disable_cuda_graph=True, mem_fraction_static=0.05,
                               max_total_tokens=2048, dtype="float32", random_seed=0,
                               skip_tokenizer_init=True, skip_server_warmup=True,
                               log_level="error")
    try:
        before = engine.generate(input_ids=PROMPT, sampling_params=sampling)[0]["output_ids"]
        answer = areal_disk_update(engine, str(b))
        after = engine.generate(input_ids=PROMPT, sampling_params=sampling)[0]["output_ids"]
        yield dict(before=before, answer=answer, after=after, checks=st.checks(),
                   expected=(_greedy(a), _greedy(b)))
    finally:
        engine.shutdown()


def test_areal_disk_update_passes_the_guard_once_and_serves_the_new_weights(areal):
    assert areal["before"] == areal["expected"][0]
    ok, message = areal["answer"][:2]
    assert ok is True, message
    assert [c["ok"] for c in areal["checks"]] == [True]  # one check, for the one update
    assert areal["checks"][0]["updates"] == ["update_weights_from_disk"]
    assert areal["after"] == areal["expected"][1]  # served on B after continue_generation
