"""graphtrace/sglang/releases.py without SGLang: the table is well formed, and a target the
running SGLang lacks is a clear line naming it (the plugin's log and the scheduler trace's
blind spot), never a traceback (Note [a target gone at plugin load])."""

from __future__ import annotations

import dataclasses

import pytest

from graphtrace.sglang import contract, plugin, releases

ADAPTER_ROLES = ("hook_registry", "load_model", "init_cuda_graphs", "enqueue", "scheduler",
                 "abort", "cpu_graph_capture", "dummy_run", "autotune_buffers", "tp_group",
                 "parallel")


@pytest.mark.parametrize("version", list(releases.RELEASES))
def test_every_row_is_well_formed(version):
    row = releases.RELEASES[version]
    assert row.version == version and releases.release(version) is row
    for role, target in row.targets.items():
        assert target.module.startswith("sglang."), (role, target)
        assert target.hook in ("call", "around", "before"), (role, target)
        assert role in ADAPTER_ROLES + ("model_context",) or (
            role.startswith("update:") and role[7:] in releases.UPDATER_METHODS), role
    for method in row.update_begins + row.complete_updates:
        assert row.target(f"update:{method}").hook == "around", method
    if row.plugins:  # graphtrace runs inside it: every role the adapter reads is named
        assert version in releases.SUPPORTED
        assert set(ADAPTER_ROLES) <= set(row.targets), set(ADAPTER_ROLES) - set(row.targets)
        assert row.complete_updates and set(row.complete_updates) <= set(releases.UPDATER_METHODS)
    else:
        assert version not in releases.SUPPORTED


def test_a_release_not_in_the_table_is_refused_by_name():
    with pytest.raises(LookupError, match=r"SGLang 0\.4\.6\.post5 is not a supported release "
                                          r"\(supported: 0\.5\.23, "):
        releases.release("0.4.6.post5")


def _row_missing(role: str) -> releases.Release:
    row = releases.RELEASES["0.5.23"]
    gone = dataclasses.replace(row.targets[role], module="sglang_renamed.model_runner")
    return dataclasses.replace(row, targets={**row.targets, role: gone})


def test_a_missing_target_is_one_line_naming_it():
    row = _row_missing("load_model")
    lines = plugin.unguarded_targets(row, plugin.hook_targets(row, guard=False))
    # (without SGLang every target is missing: one line each, no traceback)
    assert all("\n" not in line and line.endswith(": not hooked") for line in lines), lines
    named = [line for line in lines if "[load_model]" in line]
    assert named == ["sglang_renamed.model_runner: cannot import (ModuleNotFoundError: No "
                     "module named 'sglang_renamed') [load_model]: not hooked"]
    assert named[0] in plugin.unguarded()


def test_a_missing_target_is_a_blind_spot_of_the_scheduler_trace(monkeypatch):
    """The session the plugin opens (its load_model hook) carries what was not hooked: the
    engine keeps running, the report says what is not guarded."""
    row = _row_missing("init_cuda_graphs")
    monkeypatch.setattr(plugin, "_unguarded", [])
    monkeypatch.setattr(plugin, "_release", row)
    lines = plugin.unguarded_targets(row, plugin.hook_targets(row, guard=False))
    monkeypatch.setenv("GRAPHTRACE_STRICT", "0")

    import torch

    class Runner:  # what SGLang's ModelRunner.load_model is called on (model set by the load)
        tp_rank = 0

    def load(runner):
        runner.model = torch.nn.Linear(2, 2)
        loaded.append(runner)

    loaded = []
    plugin._around_load(load, Runner())
    session = plugin.session()
    try:
        assert loaded and session is not None and session.release is row
        texts = [spot.text for spot in session.trace.blind_spots]
        assert texts == [f"graphtrace cannot guard: {line}" for line in lines]
        assert any("sglang_renamed.model_runner" in t and "[init_cuda_graphs]" in t
                   for t in texts), texts
    finally:
        session.close()
        monkeypatch.setattr(plugin, "_session", None)


def test_targets_read_from_source_find_a_missing_method(tmp_path):
    """The source reading `make test-sglang-contract` uses for releases whose modules do not
    import: a method missing from a class is named with its class and module."""
    pkg = tmp_path / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runner.py").write_text("class ModelRunner:\n    def load_model(self, x=1):\n"
                                   "        self.model = x\n")
    ok = releases.Target("sglang.srt.runner", "ModelRunner.load_model", "around")
    gone = releases.Target("sglang.srt.runner", "ModelRunner.init_cuda_graphs", "around")
    assert contract.check_targets({"load_model": ok, "init_cuda_graphs": gone}, tmp_path) == [
        "sglang.srt.runner:ModelRunner.init_cuda_graphs: missing ('init_cuda_graphs' not "
        "found) [init_cuda_graphs]"]
