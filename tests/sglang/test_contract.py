"""The installed SGLang keeps graphtrace's contract (graphtrace/sglang/releases.py).

Run by ``make test-sglang`` on SGLang 0.5.23 (its modules imported) and by ``make
test-sglang-contract`` on the other rows' releases (each release's package ahead of the
0.5.23 environment, read as source: its modules do not import there), with
``GRAPHTRACE_SGLANG_RELEASE`` naming the release the run must be on. A broken target fails
with its name; nothing here skips.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from graphtrace.errors import GraphtraceError
from graphtrace.sglang import contract, plugin, releases
from tests.engine_probe import planted_copy

pytestmark = pytest.mark.sglang

UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"


def _release_under_test() -> str | None:
    return os.environ.get("GRAPHTRACE_SGLANG_RELEASE") or None


def test_installed_release_keeps_the_contract():
    version = _release_under_test()
    row = releases.release(version)
    root = contract.source_root() if version else None  # other releases: read as source
    problems = contract.check(row, root)
    assert problems == [], "\n".join(problems)


def test_reading_the_source_agrees_with_importing_on_the_installed_release():
    if _release_under_test():
        pytest.skip("the installed release's check (its modules import only on 0.5.23)")
    row = releases.release()
    assert contract.check(row) == [] and contract.check(row, contract.source_root()) == []


def _planted_updater(tmp_path: Path, monkeypatch, *renames: tuple[str, str]) -> str:
    """A copy of 0.5.23's weight_updater.py with ``renames`` applied, loaded as
    ``...scheduler_components.planted_weight_updater``."""
    import sglang.srt.managers.scheduler_components.weight_updater as original

    return planted_copy(original, f"{UPDATER.rsplit('.', 1)[0]}.planted_weight_updater",
                        tmp_path, monkeypatch, renames)


def _row_on(module: str) -> releases.Release:
    row = releases.release("0.5.23")
    return dataclasses.replace(row, targets={
        r: dataclasses.replace(t, module=module) if t.module == UPDATER else t
        for r, t in row.targets.items()})


def test_a_renamed_target_fails_the_contract_naming_it(tmp_path, monkeypatch):
    name = _planted_updater(tmp_path, monkeypatch,
                            ("def end_weight_update(", "def end_weight_update_renamed("))
    problems = contract.check_targets(_row_on(name).targets)
    assert problems == [f"{name}:SchedulerWeightUpdaterManager.end_weight_update: missing "
                        "('end_weight_update' not found) [update:end_weight_update]"]
    clean = _planted_updater(tmp_path, monkeypatch)  # the copy itself keeps the contract
    assert contract.check_targets(_row_on(clean).targets) == []


def test_a_changed_signature_fails_naming_the_target(tmp_path, monkeypatch):
    name = _planted_updater(tmp_path, monkeypatch, (
        "def update_weights_from_disk(self, recv_req",
        "def update_weights_from_disk(self, extra, recv_req"))
    problems = contract.check_targets(_row_on(name).targets)
    assert len(problems) == 1 and problems[0].startswith(
        f"{name}:SchedulerWeightUpdaterManager.update_weights_from_disk: signature "
        "(self, extra, recv_req"), problems


def test_plugin_load_with_a_renamed_target_hooks_the_rest_and_names_it(tmp_path, monkeypatch,
                                                                      caplog):
    """register() on a release whose end_weight_update is renamed: that hook is not
    registered, the log names the target, the rest are registered; strict raises with it."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    name = _planted_updater(tmp_path, monkeypatch,
                            ("def end_weight_update(", "def end_weight_update_renamed("))
    row = _row_on(name)
    registered: list[str] = []
    monkeypatch.setattr(HookRegistry, "register",
                        classmethod(lambda cls, target, hook, kind=None: registered.append(target)))
    monkeypatch.setattr(releases, "running", lambda: (row, None))
    monkeypatch.setenv("GRAPHTRACE_SGLANG", "guard")
    monkeypatch.setenv("GRAPHTRACE_STRICT", "0")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_unguarded", [])
    with caplog.at_level(logging.ERROR, logger="graphtrace.sglang"):
        plugin.register()
    line = (f"{name}:SchedulerWeightUpdaterManager.end_weight_update: missing "
            "('end_weight_update' not found) [update:end_weight_update]: not hooked")
    assert plugin.unguarded() == [line]
    assert line in caplog.text
    assert f"{name}.SchedulerWeightUpdaterManager.end_weight_update" not in registered
    assert f"{name}.SchedulerWeightUpdaterManager.begin_weight_update" in registered
    assert len(registered) == len(plugin.hook_targets(row, guard=True)) - 1

    monkeypatch.setenv("GRAPHTRACE_STRICT", "1")
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(GraphtraceError, match=r"end_weight_update: missing"):
        plugin.register()
