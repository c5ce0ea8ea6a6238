"""The placeholder sgl_kernel (requirements/sglang-placeholder): it only satisfies imports.
Whether the engine called it is tests/sglang/test_engine.py's last test."""

from __future__ import annotations

import pytest


def test_sglang_imports_the_placeholder_and_every_function_of_it_raises(tmp_path, monkeypatch):
    import sgl_kernel

    assert getattr(sgl_kernel, "PLACEHOLDER", False) is True, sgl_kernel.__file__
    log = tmp_path / "calls.log"
    monkeypatch.setenv(sgl_kernel.LOG_ENV, str(log))
    fn = sgl_kernel.copy_all_layer_kv_cache_cpu  # what sglang's memory_pool imports
    with pytest.raises(sgl_kernel.PlaceholderCalled, match="placeholder"):
        fn(1, 2)
    assert log.read_text().split()[1] == "sgl_kernel.copy_all_layer_kv_cache_cpu"
    with pytest.raises(ImportError):
        import sgl_kernel.scalar_type  # noqa: F401 - SGLang falls back when it is missing
    with pytest.raises(AttributeError):
        sgl_kernel.__wrapped__  # noqa: B018 - dunders are not placeholders
