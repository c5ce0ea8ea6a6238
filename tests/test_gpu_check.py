"""analysis/gpu_check.py: the dry run (CPU), its pure parts, its harness, and (with CUDA) the
full run. The ctypes graph reader is exercised against a fake libcuda built here with the C
compiler, so its plumbing is checked without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "analysis" / "gpu_check.py"
VARIANTS = ("unfixed-partial", "unfixed-lambda", "rejected-fix", "fixed", "marlin")
GPU_ONLY = ("demo-cuda", "stale-read", "demo-emulated-cuda", "coverage-eager", "coverage-compiled")


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


gc = load_module()


def run_script(*args, timeout, env=None):
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})
    return proc, time.perf_counter() - t


# --------------------------------------------------------------------------------------
# the dry run, once per module
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_dry")
    proc, seconds = run_script("--dry", "--out", str(out), timeout=60)
    return proc, seconds, out


def test_dry_run_exit_and_time(dry):
    proc, seconds, _ = dry
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < 60


def block_of(text: str) -> str:
    start = text.index("== graphtrace GPU check (dry run, no CUDA) ==")
    return text[start:]


def test_dry_run_block(dry):
    proc, _, out = dry
    block = block_of(proc.stdout)
    for name in ("env", "coverage-synthetic", "demo-emulated", "stale-read-emulated"):
        assert re.search(rf"^\[{name}\] ok \(", block, re.M), name
    for name in GPU_ONLY:
        assert f"[{name}] skipped: no CUDA" in block
    assert "[verdicts equal] skipped: no CUDA" in block
    assert "[compile-cpu] skipped: dry run (add --cpu-compile)" in block
    assert re.search(r"== summary: 4 ok, 6 skipped, 0 failed; .*RESULT: PASS ==", block)
    assert ("unfixed-partial: act order flipped in place: eager rows changed 15/15, replayed "
            "rows changed 0/15") in block
    assert "fixed: act order flipped in place: eager rows changed 15/15, replayed rows changed 15/15" in block
    # the same block is written to gpu_check.txt
    assert (out / "gpu_check.txt").read_text().strip().startswith(
        "== graphtrace GPU check (dry run, no CUDA) ==")
    assert block.strip().splitlines()[0] == (out / "gpu_check.txt").read_text().splitlines()[0]


def test_dry_run_emulated_verdicts_per_variant(dry):
    block = block_of(dry[0].stdout)
    for variant in VARIANTS:
        for scenario in ("new-weights", "same-weights"):
            pattern = (rf"emulated\[cpu\] {variant} {scenario}: stale=\d+ dangling=\d+ "
                       rf"diverged=\d+ perm_flagged=\d+/\d+ flip=\S+ replay_eq_eager=\d+/\d+ expected=ok")
            assert re.search(pattern, block), (variant, scenario)
    expect = {
        "unfixed-partial": "stale=16 dangling=0 diverged=0 perm_flagged=16/16 flip=0/15 replay_eq_eager=0/15",
        "unfixed-lambda": "stale=16 dangling=0 diverged=0 perm_flagged=16/16 flip=0/15 replay_eq_eager=0/15",
        "rejected-fix": "stale=0 dangling=0 diverged=16 perm_flagged=16/16 flip=0/15 replay_eq_eager=15/15",
        "fixed": "stale=0 dangling=0 diverged=0 perm_flagged=0/16 flip=15/15 replay_eq_eager=15/15",
        "marlin": "stale=32 dangling=0 diverged=0 perm_flagged=16/16 flip=0/15 replay_eq_eager=0/15",
    }
    for variant, text in expect.items():
        assert f"emulated[cpu] {variant} new-weights: {text} expected=ok" in block
    assert "kernel.act_perm.keywords['perm'] (4 layers)" in block
    assert "kernel.act_perm.__closure__['perm'] (4 layers)" in block


def test_dry_run_json(dry):
    data = json.loads((dry[2] / "gpu_check.json").read_text())
    assert data["meta"]["cuda"] is False
    checks = data["checks"]
    assert checks["demo-emulated"]["status"] == "ok"
    scen = checks["demo-emulated"]["figures"]["scenarios"]
    assert set(scen) == {f"{v}/{s}" for v in VARIANTS for s in ("new-weights", "same-weights")}
    assert scen["marlin/new-weights"]["counts"] == {"stale": 32, "dangling": 0, "diverged": 0}
    assert all(checks[n]["status"] == "skipped: no CUDA" for n in GPU_ONLY)
    assert checks["coverage-synthetic"]["figures"]["synthetic_totals"]["attributed"] == 3


# --------------------------------------------------------------------------------------
# verdict comparison
# --------------------------------------------------------------------------------------

def test_compare_demo_equal_and_different(dry):
    data = json.loads((dry[2] / "gpu_check.json").read_text())
    ref = data["checks"]["demo-emulated"]["figures"]["scenarios"]
    ok, lines = gc.compare_demo(ref, json.loads(json.dumps(ref)), "emulated[cpu]", "cuda-graphs")
    assert ok is True
    assert len(lines) == 10 and all(": yes (" in ln for ln in lines)
    assert ("verdicts equal [emulated[cpu] vs cuda-graphs] unfixed-partial new-weights: yes "
            "(stale=16 dangling=0 diverged=0") in lines[[i for i, ln in enumerate(lines)
                                                         if "unfixed-partial new-weights" in ln][0]]

    other = json.loads(json.dumps(ref))
    s = other["unfixed-lambda/new-weights"]
    s["counts"]["stale"] = 12
    s["flagged_owners"] = s["flagged_owners"][1:]
    s["owned_edges"] = s["owned_edges"][:-1]
    other["fixed/new-weights"]["flip_changed"] = 3  # soft: a note, not a difference
    del other["marlin/same-weights"]
    ok, lines = gc.compare_demo(ref, other, "emulated[cpu]", "cuda-graphs")
    assert ok is False
    text = "\n".join(lines)
    assert "unfixed-lambda new-weights: NO" in text
    assert "counts: emulated[cpu] {'stale': 16, 'dangling': 0, 'diverged': 0} vs cuda-graphs" in text
    assert "flagged_owners: only in emulated[cpu]:" in text
    assert "owned_edges: only in emulated[cpu]:" in text
    assert "fixed new-weights: yes" in text and "note: flip_changed differs" in text
    assert "marlin/same-weights: only in emulated[cpu]" in text
    assert gc.compare_demo({}, {}, "a", "b")[0] is None


def test_compare_stale_read(dry):
    data = json.loads((dry[2] / "gpu_check.json").read_text())
    ref = data["checks"]["stale-read-emulated"]["figures"]["variants"]
    assert set(ref) == set(VARIANTS)
    ok, lines = gc.compare_stale_read(ref, json.loads(json.dumps(ref)), "emulated replay", "real replay")
    assert ok is True and all(ln.endswith(": yes") for ln in lines) and len(lines) == 5
    other = json.loads(json.dumps(ref))
    other["unfixed-partial"]["flip_replay_changed"] = 15
    ok, lines = gc.compare_stale_read(ref, other, "emulated replay", "real replay")
    assert ok is False
    assert "replay agrees [emulated replay vs real replay] unfixed-partial: NO: flip_replay_changed: 0 vs 15" in lines


def test_norm_ignores_zero_counts_and_order():
    assert gc._norm({"stale": 0, "diverged": 4}) == gc._norm({"diverged": 4})
    assert gc._norm([["b", 1], ["a", 2]]) == gc._norm([["a", 2], ["b", 1]])


# --------------------------------------------------------------------------------------
# kernel-node decoding (pure) and the ctypes reader against a fake libcuda
# --------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------
# DebugMode's Triton hook and the RecordingMode patch (CPU torch)
# --------------------------------------------------------------------------------------

def test_launch_recorder_records_without_sync():
    torch = pytest.importorskip("torch")
    dm = pytest.importorskip("torch.utils._debug_mode")
    if not hasattr(dm.DebugMode, "record_triton_kernel"):
        pytest.skip("this torch's DebugMode has no Triton hook")
    rec = gc.make_launch_recorder()
    a, b = torch.zeros(16), torch.ones(4, 4)
    with rec:
        assert dm.get_active_debug_mode() is rec
        call = rec.record_triton_kernel(kernel_name="triton_poi_fused_0",
                                        kwargs={"in_ptr0": a[4:], "out_ptr0": b, "xnumel": 12})
        call.finalize(None)  # DebugMode's own would synchronize the device
        torch.add(a, 1)      # ordinary ops pass through unrecorded
    frame = rec.frame()
    assert frame[["kernel", "arg", "access"]].values.tolist() == [
        ["triton_poi_fused_0", "in_ptr0", "read"], ["triton_poi_fused_0", "out_ptr0", "write"]]
    assert frame["data_ptr"].tolist() == [a.data_ptr(), b.data_ptr()]
    assert frame["view_ptr"].tolist() == [a[4:].data_ptr(), b.data_ptr()]
    assert frame["nbytes"].tolist() == [64, 64]


def test_recording_mode_patch_is_scoped():
    pytest.importorskip("torch")
    from graphtrace.recorder import RecordingMode

    before = RecordingMode.__dict__.get("ignore_compile_internals")
    native = RecordingMode.ignore_compile_internals()
    with gc.recording_mode_ignores_compile_internals():
        assert RecordingMode.ignore_compile_internals() is True
    assert RecordingMode.__dict__.get("ignore_compile_internals") is before
    assert RecordingMode.ignore_compile_internals() is native
    with gc.recording_mode_ignores_compile_internals(False):
        assert RecordingMode.ignore_compile_internals() is native


class FakeDriver:
    """Stands in for the libcuda reader: one 'kernel node' per storage the model owns at
    capture time, plus one reading the input, so `_measure` runs end to end on a CPU."""

    def __init__(self, model, x):
        self.model, self.x = model, x

    def read_graph(self, graph):
        from graphtrace import coverage as cov
        from graphtrace.owners import walk_owners

        ptrs = {t.untyped_storage().data_ptr(): path for path, _, t in walk_owners(self.model)}
        nodes = [cov.KernelNode(f"fake_{path}", [p]) for p, path in ptrs.items()]
        nodes.append(cov.KernelNode("fake_input", [self.x.data_ptr() + 4]))
        return nodes, {"kernel": len(nodes)}


def _rehearse(model, fn, key, patch, tmp_path):
    import pandas as pd
    import torch

    ctx = gc.Ctx(key, None, None, str(tmp_path), echo=False)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    new = torch.randperm(512)
    fig = gc._measure(ctx, key, model=model, fn=fn, x=x, driver=FakeDriver(model, x),
                      compiled=fn is not model, patch=patch, use_hook=True,
                      rebind=lambda: model.set_perm(new), eager_fn=model,
                      capture_fn=gc._emulated_capture_keep,
                      memory_fn=lambda: pd.DataFrame(columns=["data_ptr", "nbytes", "label"]))
    return fig, ctx


def test_measure_rehearsal_eager_on_cpu(tmp_path):
    pytest.importorskip("torch")
    model = gc.make_small_net("cpu")
    fig, ctx = _rehearse(model, model, "small-net-eager", False, tmp_path)
    c = fig["coverage"]
    assert (c["owned"], c["owned_attributed"], c["kernels"]) == (7, 7, 8)
    assert c["pointers"] == c["attributed"] == 8
    assert fig["triton_launches_hooked"] == 0 and fig["triton_kernel_nodes"] == 0
    assert fig["replay_eq_eager_before_rebind"] == 8
    assert fig["stale_owners"] == ["act_perm.keywords['index']"]
    assert fig["replay_eq_eager_after_rebind"] == 0 and fig["replay_changed_by_rebind"] == 0
    assert (tmp_path / "gpu_coverage_kernels_small-net-eager.csv").exists()
    assert any("replay==eager before the rebind 8/8" in ln for ln in ctx.lines)


@pytest.mark.slow
def test_measure_rehearsal_compiled_on_cpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    torch._dynamo.reset()
    model = gc.make_small_net("cpu")
    fig, _ = _rehearse(model, torch.compile(model, dynamic=False), "small-net-compiled", True,
                       tmp_path)
    c = fig["coverage"]
    assert (c["owned"], c["owned_attributed"]) == (7, 4)
    assert c["unseen_owners"] == "act_perm.keywords['index']; norm_weight; scale"
    assert fig["op_names"] == ["aten::addmm.out"]
    assert fig["stale_like_edges"] == 0  # the rebound perm is read by a fused kernel only
    torch._dynamo.reset()


def test_probes_never_raise():
    pytest.importorskip("torch")
    probes = gc.probe_torch_features()
    assert set(probes) == {"cudagraph_keep_graph", "debugmode_triton_hook", "inductor_calls_hook",
                           "dynamo_dispatch_mode_rule", "cudagraph_get_graph_data"}
    assert all(isinstance(ok, bool) and isinstance(detail, str) for ok, detail in probes.values())


# --------------------------------------------------------------------------------------
# the harness: a hang, a crash and an exception each lose one check only
# --------------------------------------------------------------------------------------

def test_harness_isolates_timeout_crash_and_error(tmp_path):
    proc, _ = run_script("--dry", "--only",
                         "selftest-sleep,selftest-crash,selftest-raise,coverage-synthetic",
                         "--out", str(tmp_path), timeout=120, env={"GPU_CHECK_SELFTEST": "1"})
    assert proc.returncode == 1, proc.stdout[-3000:]
    block = (tmp_path / "gpu_check.txt").read_text()
    assert re.search(r"^\[selftest-sleep\] timeout after 3 s", block, re.M)
    assert "before the hang" in block
    assert re.search(r"^\[selftest-crash\] crashed \(signal \d+\)", block, re.M)
    assert "before the crash" in block
    assert re.search(r"^\[selftest-raise\] error", block, re.M)
    assert "ERROR in first part: ValueError: planted" in block
    assert "second part still ran" in block
    assert re.search(r"^\[coverage-synthetic\] ok", block, re.M)
    assert "1 ok, 0 skipped, 3 failed" in block and "RESULT: FAIL" in block


def test_bad_option_exit_2():
    proc, _ = run_script("--dry", "--only", "nope", timeout=60)
    assert proc.returncode == 2 and "unknown check" in proc.stderr


# --------------------------------------------------------------------------------------
# slower: torch.compile on the CPU (Inductor's C++ kernels)
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_compile_cpu_blind_spot(tmp_path):
    pytest.importorskip("torch")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    proc, _ = run_script("--dry", "--only", "compile-cpu", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    cases = data["checks"]["compile-cpu"]["figures"]["cases"]
    small = cases["small-net-cpu"]
    from graphtrace.recorder import RecordingMode

    if not RecordingMode.ignore_compile_internals():
        # as is: Dynamo runs the compiled model eagerly under the recorder, and keeps doing so
        assert small["compiled-asis"]["fell_back_to_eager"] is True
        assert small["compiled-asis"]["ops_per_call_after"] == small["eager"]["ops"]
    else:  # the recorder declares ignore_compile_internals: compiled code stays compiled
        assert small["compiled-asis"]["fell_back_to_eager"] is False
    # compiled code kept (patched mode): the fused kernels' reads are invisible
    assert small["compiled-patched"]["owned_missing_vs_eager"] == [
        "act_perm.keywords['index']", "norm_weight", "scale"]
    assert small["compiled-patched"]["stale_missed_vs_eager"] == ["act_perm.keywords['index']"]
    demo = cases["demo-unfixed-lambda-cpu"]
    assert demo["compiled-patched"]["op_names"] == ["graphtrace::machete_mm"]
    assert len(demo["compiled-patched"]["stale_missed_vs_eager"]) == 2
    assert all("act_perm.__closure__['perm']" in o for o in demo["compiled-patched"]["stale_missed_vs_eager"])


# --------------------------------------------------------------------------------------
# CUDA: the full run
# --------------------------------------------------------------------------------------

def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_full_run_on_cuda(tmp_path):
    proc, _ = run_script("--out", str(tmp_path), timeout=900)
    block = (tmp_path / "gpu_check.txt").read_text()
    assert proc.returncode == 0, block[-6000:]
    for name in ("env", "demo-emulated", "demo-cuda", "stale-read", "demo-emulated-cuda",
                 "coverage-eager"):
        assert re.search(rf"^\[{name}\] ok", block, re.M), name
    for variant in VARIANTS:
        for scenario in ("new-weights", "same-weights"):
            assert (f"verdicts equal [emulated[cpu] vs cuda-graphs] {variant} {scenario}: yes"
                    in block)
        assert f"replay agrees [emulated replay vs real replay] {variant}: yes" in block
    assert "unfixed-partial: act order flipped in place: eager rows changed 15/15, replayed rows changed 0/15" in block
    assert "RESULT: PASS" in block
