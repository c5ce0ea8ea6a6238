"""Test support for the case sglang-6265-deepseek-w-kc in SGLang itself
(tests/sglang/test_case_deepseek_w_kc.py), loaded in SGLang's processes as a plugin (entry
point ``graphtrace_test_deepseek``). When ``GRAPHTRACE_TEST_DEEPSEEK`` names a mode file and
it reads ``assign``, SGLang's DeepSeek weight loader binds new ``w_kc`` / ``w_vc`` tensors at
every ``post_load_weights`` (#4961's behaviour) instead of copying into the existing ones
(``bind_or_assign``, #6265's fix, as SGLang 0.5.23 ships it). Read at each call.
"""

from __future__ import annotations

import os

ENV = "GRAPHTRACE_TEST_DEEPSEEK"
LOADER = "sglang.srt.models.deepseek_common.deepseek_weight_loader"


def register() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    import importlib

    loader = importlib.import_module(LOADER)
    shipped = loader.bind_or_assign

    def bind_or_assign(target, source):
        try:
            mode = open(path).read().strip()
        except OSError:
            mode = "fixed"
        return source if mode == "assign" else shipped(target, source)

    loader.bind_or_assign = bind_or_assign
