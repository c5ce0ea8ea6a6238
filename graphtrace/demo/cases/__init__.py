"""The case library: published stale-read bugs as small runnable reproductions.

`graphtrace demo --case NAME` (repeatable), `--case all`, `--list-cases`. Each module
defines one `Case` (`CASE`): its reference, what was rebound and what held it, the fix,
and per variant what graphtrace must report (see `spec`). `CASES` maps names to cases in
the order below.
"""

from __future__ import annotations

import importlib

from .spec import Case, Expect, Finding, Finds, Outcome, Variant, VariantResult  # noqa: F401

__all__ = ["MODULES", "get", "select"]

MODULES = (
    "vllm_48539_machete_act_perm",
    "vllm_48438_marlin",
    "vllm_48251_mla_sinks",
    "vllm_41670_cutlass_fp8_moe",
    "vllm_40390_moe_shuffle",
    "vllm_46009_moe_padding",
    "vllm_50521_flashinfer_swiglu",
    "sglang_6265_deepseek_w_kc",
    "sglang_27140_mamba_state",
    "megatron_6723_a_neg_exp_cache",
    "rl_load_weights_no_process",
    "rocm_atom_2028_scale_normalise",
    "sglang_26194_permute_index_cache",
    "control_same_storage",
)

CASES: dict[str, Case] = {}
for _m in MODULES:
    _case = importlib.import_module(f"{__name__}.{_m}").CASE
    CASES[_case.name] = _case


def get(name: str) -> Case:
    """The case called `name`; a KeyError that lists the names otherwise."""
    try:
        return CASES[name]
    except KeyError:
        raise KeyError(f"unknown case {name!r}; cases: {', '.join(CASES)}") from None


def select(names: list[str]) -> list[Case]:
    """Cases for `--case` values ("all" for every case), in the order given, once each."""
    out: list[Case] = []
    for name in names:
        for case in (CASES.values() if name == "all" else [get(name)]):
            if case not in out:
                out.append(case)
    return out
