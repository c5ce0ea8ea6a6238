"""graphtrace.coverage on synthetic kernel nodes: exact numbers, boundaries, tiers, hooks."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from graphtrace import coverage as cov

# --------------------------------------------------------------------------------------
# a synthetic report: storages and accesses frames as graphtrace writes them
# --------------------------------------------------------------------------------------

W, X, TMP, OTHER, VIEWED = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000
PERM, SCALE = 0x6000, 0x7000


def storages():
    return pd.DataFrame({
        "storage_id": [0, 1, 2, 3, 4],
        "data_ptr": [W, X, TMP, OTHER, VIEWED],
        "nbytes": [0x100, 0x40, 0x80, 0x100, 0x10],
        "device": ["cuda:0"] * 5,
        "alive": [True, True, False, True, True],
        "first_access": ["read", "read", "factory", "read", "view"],
    })


def accesses():
    rows = [  # graph_id, storage_id, access
        (0, 0, "read"), (0, 1, "read"), (0, 2, "factory"), (0, 2, "read"), (0, 4, "view"),
        (1, 3, "read"), (1, 0, "read"),
    ]
    df = pd.DataFrame(rows, columns=["graph_id", "storage_id", "access"])
    df["graph"] = df["graph_id"].map({0: "bs1", 1: "bs2"})
    return df


def owned():
    return pd.DataFrame({
        "data_ptr": [W, PERM, SCALE],
        "nbytes": [0x100, 0x20, 0x40],
        "label": ["l1.weight", "act_perm.keywords['perm']", "scale"],
    })


def memory():  # one allocator segment spanning everything (overlaps every storage)
    return pd.DataFrame({"data_ptr": [0x1000], "nbytes": [0xF000], "label": ["segment 0"]})


def hook():  # a Triton launch hook saw the perm (and nothing else)
    return pd.DataFrame({"data_ptr": [PERM], "nbytes": [0x20], "label": ["triton_poi_0:in_ptr1"]})


NODES = [
    cov.KernelNode("gemm", [W, X + 0x3F, TMP + 0x80, 7]),             # seen, seen (last byte), allocator (end of TMP), scalar
    cov.KernelNode("triton_poi_fused_0", [PERM + 0x1F, SCALE, TMP + 0x10, W + 0x100]),
    {"name": "copy_kernel", "values": [OTHER, VIEWED + 8]},            # seen only in graph 1; view-only
    ("empty_kernel", []),
    cov.KernelNode("dup", [W, W + 8, W + 16]),                          # one storage, three words
]


def result(graph_id=0, **kw):
    return cov.graph_coverage(NODES, storages(), accesses(), graph_id, owned=owned(),
                              memory=memory(), hook=hook(), **kw)


# --------------------------------------------------------------------------------------
# locate: interval search
# --------------------------------------------------------------------------------------

def test_locate_disjoint_and_boundaries():
    starts = [300, 100, 200]
    sizes = [50, 10, 0]  # index 2 is zero-size: holds nothing
    values = [100, 109, 110, 99, 300, 349, 350, 200, 0, 2**64 - 1]
    assert cov.locate(values, starts, sizes).tolist() == [1, 1, -1, -1, 0, 0, -1, -1, -1, -1]


def test_locate_overlapping_innermost_wins_and_long_earlier_range():
    # [0, 1000) holds [100, 110) and [500, 510); a value past the nearest range's end but
    # inside the long one must still be found (the brute-force pass)
    starts = [0, 100, 500]
    sizes = [1000, 10, 10]
    values = [105, 120, 505, 999, 1000]
    assert cov.locate(values, starts, sizes).tolist() == [1, 0, 2, 0, -1]


def test_locate_large_unsigned_and_empty():
    big = 2**63 + 5
    assert cov.locate([big, big + 16], np.array([big], dtype=np.uint64), [16]).tolist() == [0, -1]
    assert cov.locate([], [1], [1]).tolist() == []
    assert cov.locate([1, 2], [], []).tolist() == [-1, -1]
    with pytest.raises(ValueError):
        cov.locate([1], [1, 2], [1])


def test_locate_matches_brute_force_on_random_ranges():
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 10_000, 200)
    sizes = rng.integers(0, 300, 200)
    values = rng.integers(0, 10_500, 2000)
    got = cov.locate(values, starts, sizes)
    for v, g in zip(values.tolist(), got.tolist()):
        inside = [i for i in range(200) if starts[i] <= v < starts[i] + sizes[i]]
        if not inside:
            assert g == -1
        else:
            assert g in inside and starts[g] == max(starts[i] for i in inside)


# --------------------------------------------------------------------------------------
# raw bytes -> words
# --------------------------------------------------------------------------------------

def test_param_words_sizes():
    p8 = struct.pack("<Q", 0xDEADBEEF000)
    p4 = struct.pack("<i", 7)
    p20 = struct.pack("<QQi", 0x1000, 0x2000, 3)  # a by-value struct: two words scanned, tail skipped
    words = cov.param_words([(0, p8), (1, p4), (2, p20), (3, b"")])
    assert words == [(0, 0, 0xDEADBEEF000, False), (2, 0, 0x1000, True), (2, 8, 0x2000, True)]


def test_scan_words_offsets():
    buf = struct.pack("<QQ", 1, 2**64 - 1) + b"\x01\x02\x03"
    assert cov.scan_words(buf, base_offset=16) == [(16, 1), (24, 2**64 - 1)]
    assert cov.scan_words(b"\x00" * 7) == []


def test_pointer_frame_inputs_and_from_words():
    node = cov.KernelNode.from_words("k", cov.param_words([(0, struct.pack("<Q", 5)),
                                                            (1, struct.pack("<QQ", 6, 7))]), node=9)
    df = cov.pointer_frame([node, ("pair", [1, 2]), {"name": "d", "values": [3]}])
    assert list(df.columns) == cov.POINTER_COLUMNS
    assert df["node"].tolist() == [9, 9, 9, 1, 1, 2]
    assert df["param"].tolist() == [0, 1, 1, 0, 1, 0]
    assert df["offset"].tolist() == [0, 0, 8, 0, 0, 0]
    assert df["scanned"].tolist() == [False, True, True, False, False, False]
    assert df["value"].dtype == np.uint64
    with pytest.raises(ValueError):
        cov.pointer_frame([cov.KernelNode("bad", [1, 2], params=[0])])


# --------------------------------------------------------------------------------------
# coverage: exact numbers
# --------------------------------------------------------------------------------------

def test_tiers_of_every_word():
    r = result()
    p = r.pointers
    got = {(int(n), int(v)): t for n, v, t in zip(p["node"], p["value"], p["tier"])}
    assert got == {
        (0, W): "seen", (0, X + 0x3F): "seen", (0, TMP + 0x80): "allocator", (0, 7): "none",
        (1, PERM + 0x1F): "owned", (1, SCALE): "owned", (1, TMP + 0x10): "seen-freed",
        (1, W + 0x100): "allocator",
        (2, OTHER): "seen-other", (2, VIEWED + 8): "seen-other",  # view-only does not attribute
        (4, W): "seen", (4, W + 8): "seen", (4, W + 16): "seen",
    }
    hooked = p[p["hooked"]]
    assert hooked["value"].tolist() == [PERM + 0x1F]
    assert set(p.loc[p["owned"], "owner"]) == {"l1.weight", "act_perm.keywords['perm']", "scale"}
    assert p.loc[p["value"] == W, "storage_id"].tolist() == [0, 0]


def test_per_kernel_numbers():
    per = result().per_kernel.set_index("node")
    assert per.loc[0, ["words", "pointers", "attributed", "owned", "owned_attributed"]].tolist() == [4, 3, 2, 1, 1]
    assert per.loc[0, "coverage"] == pytest.approx(2 / 3)
    assert per.loc[1, ["words", "pointers", "attributed", "attributed_with_hook", "owned",
                       "owned_attributed", "seen_freed"]].tolist() == [4, 4, 1, 2, 2, 0, 1]
    assert per.loc[1, "coverage"] == 0.25 and per.loc[1, "coverage_with_hook"] == 0.5
    assert per.loc[1, "unseen_owners"] == "act_perm.keywords['perm']; scale"
    assert per.loc[2, ["pointers", "attributed"]].tolist() == [2, 0]
    assert per.loc[3, ["kernel", "words", "pointers"]].tolist() == ["empty_kernel", 0, 0]
    assert math.isnan(per.loc[3, "coverage"])
    assert per.loc[4, ["words", "pointers", "attributed"]].tolist() == [3, 1, 1]  # deduped
    assert list(result().per_kernel.columns) == cov.PER_KERNEL_COLUMNS


def test_totals():
    t = result().totals
    assert {k: t[k] for k in ("kernels", "kernels_with_pointers", "kernels_fully_attributed",
                              "words", "pointers", "attributed", "attributed_with_hook", "owned",
                              "owned_attributed", "seen_freed")} == {
        "kernels": 5, "kernels_with_pointers": 4, "kernels_fully_attributed": 1, "words": 13,
        "pointers": 10, "attributed": 4, "attributed_with_hook": 5, "owned": 4,
        "owned_attributed": 2, "seen_freed": 1}
    assert t["coverage"] == pytest.approx(0.4)
    assert t["coverage_with_hook"] == pytest.approx(0.5)
    assert t["owned_coverage"] == pytest.approx(0.5)
    assert [t[f"tier_{x}"] for x in cov.TIERS] == [3, 1, 2, 2, 2]
    assert t["unseen_owners"] == "act_perm.keywords['perm']; scale"


def test_no_dedupe_counts_every_word():
    t = result(dedupe=False).totals
    assert t["pointers"] == 12 and t["attributed"] == 6


def test_other_graph_and_all_graphs():
    per1 = result(graph_id=1).per_kernel.set_index("node")
    # graph 1 read OTHER and W: the copy kernel is attributed, the freed TMP is not its own
    assert per1.loc[2, ["pointers", "attributed"]].tolist() == [2, 1]
    assert per1.loc[0, "attributed"] == 1  # W; X was recorded in graph 0 only (seen-other)
    t_all = result(graph_id=None).totals
    assert t_all["attributed"] == 5  # W, X (node 0), TMP (node 1), OTHER (node 2), W (node 4)
    assert t_all["tier_seen-other"] == 1  # VIEWED: only ever a view


def test_view_counts_when_asked():
    per = result(access_kinds=None).per_kernel.set_index("node")
    assert per.loc[2, "attributed"] == 1


def test_without_optional_ranges():
    r = cov.graph_coverage(NODES, storages(), accesses(), 0)
    t = r.totals
    assert t["owned"] == 0 and t["attributed_with_hook"] == t["attributed"] == 4
    assert t["pointers"] == 6  # W, X, TMP(freed), OTHER, VIEWED, W(dup) -- allocator/owned unknown
    assert r.notes and "freed" in r.notes[0]


def test_empty_inputs():
    r = cov.graph_coverage([], storages(), accesses(), 0)
    assert r.totals["kernels"] == 0 and math.isnan(r.totals["coverage"])
    r = cov.graph_coverage([("k", [])], storages().iloc[:0], accesses().iloc[:0], 0)
    assert r.totals["kernels"] == 1 and r.totals["pointers"] == 0


def test_format_coverage_lines():
    r = result()
    lines = cov.format_coverage(r.per_kernel, r.total)
    assert lines[-1].startswith("  total: 5 kernel nodes, 10 pointers")
    assert "attributed 4 (40.0%)" in lines[-1] and "with hook 5 (50.0%)" in lines[-1]
    assert "model-owned 2/4 (50.0%)" in lines[-1]
    assert any("triton_poi_fused_0" in ln and "unseen: act_perm" in ln for ln in lines)
    assert not any("empty_kernel" in ln for ln in lines)


# --------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------

def test_triton_arg_access():
    assert cov.triton_arg_access("in_ptr0") == "read"
    assert cov.triton_arg_access("out_ptr12") == "write"
    assert cov.triton_arg_access("in_out_ptr1") == "read+write"
    for name in ("xnumel", "ws_ptr", "in_ptr", "ptr0"):
        assert cov.triton_arg_access(name) is None


def test_short_kernel_name():
    assert cov.short_kernel_name("triton_poi_fused_mul_0") == "triton_poi_fused_mul_0"
    demangled = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl"
                 "(at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, float)")
    assert cov.short_kernel_name(demangled) == "at::native::vectorized_elementwise_kernel<…>"
    mangled = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_T1_"
    assert cov.short_kernel_name(mangled) == "vectorized_elementwise_kernel"
    assert len(cov.short_kernel_name("x" * 100, width=20)) == 20


def test_module_imports_without_torch():
    code = ("import sys; import graphtrace.coverage; "
            "assert 'torch' not in sys.modules, 'graphtrace.coverage imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_coverage_has_one_meaning():
    """Only this module's kernel-pointer measure is called coverage: no function anywhere in
    the package is named plain `coverage`, and `graphtrace.analysis` (now `graphtrace.explore`,
    apart from the analysis/ scripts) is gone."""
    import ast
    from pathlib import Path

    pkg = Path(cov.__file__).resolve().parent
    plain = [f"{p.relative_to(pkg.parent)}:{node.lineno}" for p in sorted(pkg.rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "coverage"]
    assert not plain, plain
    named = [n for n in cov.__all__ if "coverage" in n.lower()]
    assert set(named) == {"kernel_coverage", "graph_coverage", "format_coverage", "CoverageResult"}
    assert not (pkg / "analysis.py").exists()
