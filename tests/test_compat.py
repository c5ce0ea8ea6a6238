"""graphtrace._compat: what it checks at import, and how it fails (Note [torch compatibility]).

The fail-open paths are exercised by loading a fresh copy of the module while an API it needs
is taken away from torch (monkeypatch puts it back).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.utils._python_dispatch
import torch.utils._pytree

from graphtrace import _compat

PATH = _compat.__file__


def _fresh_compat():
    spec = importlib.util.spec_from_file_location("graphtrace._compat_probe", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _version() -> tuple[int, int]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def test_a_tested_torch_has_everything():
    assert _compat.missing() == {}
    assert _compat.PROVENANCE and _compat.DYNAMO_CACHE and _compat.PROVENANCE_OFF == ""
    # the bound names are torch's own functions, not wrappers (no call layer on hot paths)
    assert _compat.storage_weak_ref is torch.UntypedStorage._weak_ref
    assert _compat.free_weak_ref is torch.UntypedStorage._free_weak_ref
    assert _compat.tree_iter is torch.utils._pytree.tree_iter
    assert _compat.TorchDispatchMode is torch.utils._python_dispatch.TorchDispatchMode
    assert _compat.dispatch_stack_len is torch._C._len_torch_dispatch_stack


def test_the_direct_op_call_is_known_per_torch_version():
    expected = {(2, 13): True, (2, 14): False}
    if _version() not in expected:
        pytest.skip(f"torch {torch.__version__} is outside the tested range")
    assert _compat.OP_CALLS_OP_DIRECTLY is expected[_version()]


def test_the_lazy_lookups_find_their_classes():
    assert _compat.load_compiled_fx_graph().__name__ == "CompiledFxGraph"
    assert _compat.load_output_graph().__name__ == "OutputGraph"


def test_a_missing_optional_api_turns_its_feature_off_with_a_warning(monkeypatch):
    monkeypatch.delattr(torch.utils._python_dispatch, "_push_mode")
    with pytest.warns(RuntimeWarning,  # the probe's own TorchCompatWarning class
                      match=r"provenance .* is off: torch .* lacks "
                            r"torch\.utils\._python_dispatch\._push_mode"):
        probe = _fresh_compat()
    assert not probe.PROVENANCE and probe.DYNAMO_CACHE
    assert list(probe.missing()) == [next(iter(probe.missing()))]  # one feature off
    assert "torch.utils._python_dispatch._push_mode" in probe.PROVENANCE_OFF
    with pytest.raises(probe.TorchIncompatible, match="_push_mode"):
        probe.push_mode(None)
    with pytest.raises(probe.TorchIncompatible, match="_push_mode"):
        probe.pop_mode()  # the feature's other names are off with it
    assert probe.tree_iter is _compat.tree_iter  # recording is untouched


def test_provenance_is_off_by_default_and_refused_when_asked_for(monkeypatch):
    """What provenance.py does with the flag (fail open by default, a clear error when asked)."""
    from graphtrace import provenance

    monkeypatch.delenv(provenance.ENV, raising=False)
    monkeypatch.setattr(provenance, "PROVENANCE", False)
    monkeypatch.setattr(provenance, "PROVENANCE_OFF", "graphtrace: provenance is off: (test)")
    assert provenance.enabled_by_default() is False
    with pytest.raises(_compat.TorchIncompatible, match=r"provenance is off: \(test\)"):
        provenance.Provenance(lambda *a: None).start({})


def test_a_missing_dynamo_cache_turns_attribution_checks_off(monkeypatch):
    import torch._C._dynamo.eval_frame as eval_frame

    monkeypatch.delattr(eval_frame, "_debug_get_cache_entry_list")
    with pytest.warns(RuntimeWarning, match="Dynamo compiled"):  # the probe's own class
        probe = _fresh_compat()
    assert not probe.DYNAMO_CACHE and probe.PROVENANCE


def test_a_missing_recording_api_fails_the_import_naming_it(monkeypatch):
    monkeypatch.delattr(torch.utils._pytree, "tree_iter")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning first: the error says it all
        with pytest.raises(ImportError, match=r"cannot record on torch .* lacks "
                                              r"torch\.utils\._pytree\.tree_iter .*load_report"):
            _fresh_compat()
