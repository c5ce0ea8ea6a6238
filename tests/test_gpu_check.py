"""analysis/gpu_check.py and the CPU-runnable parts of the GPU checks (tests/gpu/checks.py):
the dry run (every GPU test skipped, the results file still written), the emulated reference
the GPU tests compare against, the comparisons, the stale-read rehearsal on emulated replay,
the coverage measurement rehearsed with a fake kernel-node reader, and (with CUDA) the full
run. The libcuda reader itself is tested in tests/test_cuda_nodes.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "analysis" / "gpu_check.py"
VARIANTS = ("unfixed-partial", "unfixed-lambda", "rejected-fix", "fixed", "marlin")
N_GPU_TESTS = 22


from analysis import gpu_check as script
from tests.gpu import checks


def results(out: Path, suffix: str) -> Path:
    """The one results file of a run in `out` (gpu_check_TAG.suffix)."""
    found = sorted(out.glob(f"gpu_check_*{suffix}"))
    assert len(found) == 1, found
    return found[0]


def run_script(*args, timeout, env=None):
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)
    return proc, time.perf_counter() - t


# --------------------------------------------------------------------------------------
# the dry run: pytest -m cuda tests/gpu with every test skipped, results still written
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_dry")
    proc, seconds = run_script("--dry", "--out", str(out), timeout=120)
    return proc, seconds, out


def test_dry_run_exit_and_time(dry):
    proc, seconds, _ = dry
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < 60


def test_dry_run_results_file(dry):
    proc, _, out = dry
    text = results(out, ".txt").read_text()
    lines = text.splitlines()
    assert lines[0] == "== graphtrace GPU check (dry run, no CUDA) =="
    assert proc.stdout.startswith(lines[0])
    assert re.search(r"^env: torch \S+ .*CUDA available: False$", text, re.M)
    # the preflight imported every module the checks use and built (or refused) the recorder
    imported = re.search(r"^preflight: (\d+) modules imported, 0 failed$", text, re.M)
    assert imported and int(imported.group(1)) > 40
    assert re.search(r"^recorder: (native, built or found in \d+ s \(.+\)|Python writer: .+)$", text,
                     re.M)
    # env first, then every check, each skipped with the one reason
    tests = [ln for ln in lines if ln.startswith("[")]
    assert len(tests) == N_GPU_TESTS
    assert tests[0].startswith("[test_env::test_env] skipped")
    assert all(ln.endswith("skipped: needs CUDA: dry run (GRAPHTRACE_GPU_DRY=1)") for ln in tests)
    for variant in VARIANTS:
        assert f"[test_demo_cuda::test_demo_on_cuda_graphs[{variant}]] skipped" in text
        assert f"[test_stale_read::test_stale_read_on_real_replay[{variant}]] skipped" in text
    for name in ("small_net_eager", "demo_eager", "small_net_compiled", "demo_compiled"):
        assert f"[test_coverage_cuda::test_coverage_{name}] skipped" in text
    assert f"== summary: 0 passed, {N_GPU_TESTS} skipped, 0 failed; RESULT: PASS ==" in text


def test_dry_run_json(dry):
    data = json.loads(results(dry[2], ".json").read_text())
    assert data["meta"]["cuda"] is False and data["meta"]["pytest_rc"] == 0
    assert len(data["tests"]) == N_GPU_TESTS
    assert {t["outcome"] for t in data["tests"]} == {"skipped"}
    assert re.search(rf"= {N_GPU_TESTS} skipped in [\d.]+s =", results(dry[2], ".log").read_text())


def test_bad_option_exit_2():
    proc, _ = run_script("--dry", "--timeout", "0", timeout=60)
    assert proc.returncode == 2 and "--timeout must be positive" in proc.stderr
    proc, _ = run_script("--nope", timeout=60)
    assert proc.returncode == 2


def test_results_block_counts_failures_and_unfinished_runs():
    meta = {"mode": "full run, CUDA", "started": "now", "pytest_rc": 1, "env": ["torch x"]}
    tests = [
        {"nodeid": "tests/gpu/test_env.py::test_env", "outcome": "passed", "seconds": 1.0,
         "lines": ["device: H200"]},
        {"nodeid": "tests/gpu/test_x.py::test_a[v]", "outcome": "failed", "when": "call",
         "seconds": 2.0, "lines": ["figure 3/15"], "message": "E   assert 3 == 15"},
        {"nodeid": "tests/gpu/test_x.py::test_b", "outcome": "skipped", "message": "why"},
    ]
    block = script.format_block(meta, tests)
    assert block[2] == "env: torch x"
    assert "[test_env::test_env] passed (1.0 s)" in block and "  device: H200" in block
    assert "[test_x::test_a[v]] failed (2.0 s)" in block and "  | E   assert 3 == 15" in block
    assert "[test_x::test_b] skipped: why" in block
    assert block[-1] == "== summary: 1 passed, 1 skipped, 1 failed; RESULT: FAIL =="
    ok = script.format_block({**meta, "pytest_rc": 0}, tests[:1])
    assert ok[-1].endswith("RESULT: PASS ==")
    cut = script.format_block({**meta, "pytest_rc": 124, "incomplete": "timeout after 9 s",
                               "tail": ["last"]}, tests[:1])
    assert "pytest did not finish: timeout after 9 s" in cut and cut[-1].endswith("RESULT: FAIL ==")


def test_preflight_import_failure_fails_the_run(monkeypatch):
    names = ["graphtrace.vocab", "graphtrace.no_such_module_here"]
    monkeypatch.setattr(script, "check_modules", lambda: names)
    n, problems = script.import_problems()
    assert n == 2 and len(problems) == 1
    assert problems[0].startswith("graphtrace.no_such_module_here: ModuleNotFoundError")
    meta = {"mode": "dry run, no CUDA", "started": "now", "pytest_rc": 0, "imported": n,
            "import_problems": problems, "recorder": "native, built or found in 1 s (x)"}
    block = script.format_block(meta, [])
    assert "preflight: 2 modules imported, 1 failed" in block
    assert "recorder: native, built or found in 1 s (x)" in block
    assert block[-1].endswith("RESULT: FAIL ==")
    assert script.format_block({**meta, "import_problems": []}, [])[-1].endswith("RESULT: PASS ==")


def test_check_modules_cover_graphtrace_and_the_gpu_tests():
    names = script.check_modules()
    assert {"graphtrace.tracing", "graphtrace.cuda_nodes", "graphtrace.demo.runner",
            "tests.gpu.checks", "tests.gpu.test_env", "tests.gpu.test_stale_read"} <= set(names)
    assert not [n for n in names if n.startswith("graphtrace.vllm") or n.endswith("__main__")]


def test_recorder_build_failure_falls_back_to_the_python_writer(monkeypatch):
    def failed(cmd, **kwargs):
        assert cmd[1:] == ["-m", "graphtrace.native"] and "GRAPHTRACE_NATIVE" not in kwargs["env"]
        return subprocess.CompletedProcess(cmd, 1, "", "build failed\nRuntimeError: no g++ here")

    monkeypatch.setenv("GRAPHTRACE_NATIVE", "1")
    monkeypatch.setattr(script.subprocess, "run", failed)
    built, text = script.build_recorder(10)
    assert not built
    assert text == ("Python writer: the native recorder did not build here (RuntimeError: no g++ "
                    "here); GRAPHTRACE_NATIVE=0 for the checks")

    def slow(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(script.subprocess, "run", slow)
    assert script.build_recorder(7) == (
        False, "Python writer: the native recorder's build ran past 7 s (GRAPHTRACE_NATIVE=0 "
               "for the checks)")


def test_checks_run_without_plugins_and_with_the_recorder_chosen(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen.update(cmd=cmd, **kwargs)
        return subprocess.CompletedProcess(cmd, 5, "no tests ran", "")

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    monkeypatch.delenv("GRAPHTRACE_NATIVE", raising=False)
    args = script.build_parser().parse_args(["--dry", "-k", "stale"])
    rc, tests, _, incomplete = script.run_pytest(args, tmp_path, 12.5, native=False)
    assert (rc, tests, incomplete) == (5, [], None)
    assert seen["timeout"] == 12.5 and seen["cmd"][-2:] == ["-k", "stale"]
    env = seen["env"]
    assert env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"  # the lent image's plugins stay out
    assert env["GRAPHTRACE_NATIVE"] == "0" and env["GRAPHTRACE_GPU_DRY"] == "1"
    script.run_pytest(script.build_parser().parse_args([]), tmp_path, 9, native=True)
    assert "GRAPHTRACE_NATIVE" not in seen["env"]


def test_results_tag_names_gpu_driver_torch_and_cuda(monkeypatch):
    import torch

    tag = script.results_tag(False)
    assert tag == re.sub(r"[^A-Za-z0-9._-]+", "-", f"no-GPU_driver-none_torch-{torch.__version__}"
                         f"_cuda-{torch.version.cuda or 'cpu'}")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(script, "driver_version", lambda: "580.159.04")
    tag = script.results_tag(True)
    assert tag.startswith("NVIDIA-H200_driver-580.159.04_torch-")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", tag)


def test_time_limit_interrupts_and_restores():
    import signal

    before = signal.getsignal(signal.SIGALRM)
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match="slow-thing ran past its 0.2 s limit"):
        with checks.time_limit(0.2, "slow-thing"):
            time.sleep(5)
    assert time.perf_counter() - t < 2
    assert signal.getsignal(signal.SIGALRM) is before
    with checks.time_limit(5):
        pass


# --------------------------------------------------------------------------------------
# the emulated reference the GPU tests compare against, and the comparisons
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    notes = checks.Notes(echo=False)
    scenarios = {}
    for variant in VARIANTS:
        s, ok, verdict = checks.demo_variant(notes, variant, "cpu", "emulated[cpu]", True)
        assert ok, verdict
        scenarios.update(s)
    return scenarios, notes


def test_emulated_reference_per_variant(reference):
    scenarios, notes = reference
    assert set(scenarios) == {f"{v}/{s}" for v in VARIANTS for s in ("new-weights", "same-weights")}
    text = "\n".join(notes.lines)
    expect = {
        "unfixed-partial": "stale=16 dangling=0 diverged=0 perm_flagged=16/16 flip=0/15 replay_eq_eager=0/15",
        "unfixed-lambda": "stale=16 dangling=0 diverged=0 perm_flagged=16/16 flip=0/15 replay_eq_eager=0/15",
        "rejected-fix": "stale=0 dangling=0 diverged=16 perm_flagged=16/16 flip=0/15 replay_eq_eager=15/15",
        "fixed": "stale=0 dangling=0 diverged=0 perm_flagged=0/16 flip=15/15 replay_eq_eager=15/15",
        "marlin": "stale=32 dangling=0 diverged=0 perm_flagged=16/16 flip=0/15 replay_eq_eager=0/15",
    }
    for variant, figures in expect.items():
        assert f"emulated[cpu] {variant} new-weights: {figures} expected=ok" in text
    assert scenarios["marlin/new-weights"]["counts"] == {"stale": 32, "dangling": 0, "diverged": 0}
    assert all(s["n_errors"] == 0 and s["expected"] == "ok" for s in scenarios.values())
    assert "kernel.act_perm.keywords['perm'] (4 layers)" in text
    assert "kernel.act_perm.__closure__['perm'] (4 layers)" in text


def test_compare_demo_equal_and_different(reference):
    ref = json.loads(json.dumps(reference[0]))
    ok, lines = checks.compare_demo(ref, json.loads(json.dumps(ref)), "emulated[cpu]", "cuda-graphs")
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
    ok, lines = checks.compare_demo(ref, other, "emulated[cpu]", "cuda-graphs")
    assert ok is False
    text = "\n".join(lines)
    assert "unfixed-lambda new-weights: NO" in text
    assert "counts: emulated[cpu] {'stale': 16, 'dangling': 0, 'diverged': 0} vs cuda-graphs" in text
    assert "flagged_owners: only in emulated[cpu]:" in text
    assert "owned_edges: only in emulated[cpu]:" in text
    assert "fixed new-weights: yes" in text and "note: flip_changed differs" in text
    assert "marlin/same-weights: only in emulated[cpu]" in text
    assert checks.compare_demo({}, {}, "a", "b")[0] is None


def test_norm_ignores_zero_counts_and_order():
    assert checks._norm({"stale": 0, "diverged": 4}) == checks._norm({"diverged": 4})
    assert checks._norm([["b", 1], ["a", 2]]) == checks._norm([["a", 2], ["b", 1]])


# --------------------------------------------------------------------------------------
# the stale read on emulated replay (the rehearsal and reference of tests/gpu's real one)
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stale_read():
    notes = checks.Notes(echo=False)
    return {v: checks.stale_read_figures(notes, v, "cpu") for v in VARIANTS}, notes


def test_stale_read_on_emulated_replay(stale_read):
    figures, notes = stale_read
    for variant, fig in figures.items():
        assert checks.stale_read_problems(variant, fig) == [], (variant, fig)
    text = "\n".join(notes.lines)
    assert ("unfixed-partial: act order flipped in place: eager rows changed 15/15, replayed "
            "rows changed 0/15") in text
    assert "fixed: act order flipped in place: eager rows changed 15/15, replayed rows changed 15/15" in text
    assert "  -> STALE READ on emulated replay: the graphs compute with the capture-time" in text
    assert "  -> CLEAN: emulated replay follows every update, as eager does" in text


def test_stale_read_problems_can_fail(stale_read):
    fig = dict(stale_read[0]["unfixed-partial"], flip_replay_changed=15)
    assert checks.stale_read_problems("unfixed-partial", fig) == ["expected a stale read"]
    fig = dict(stale_read[0]["fixed"], stale_like_edges=2)
    assert checks.stale_read_problems("fixed", fig) == ["expected replay to follow the live model"]


def test_compare_stale_read(stale_read):
    ref = json.loads(json.dumps(stale_read[0]))
    ok, lines = checks.compare_stale_read(ref, json.loads(json.dumps(ref)), "emulated replay", "real replay")
    assert ok is True and all(ln.endswith(": yes") for ln in lines) and len(lines) == 5
    other = json.loads(json.dumps(ref))
    other["unfixed-partial"]["flip_replay_changed"] = 15
    ok, lines = checks.compare_stale_read(ref, other, "emulated replay", "real replay")
    assert ok is False
    assert "replay agrees [emulated replay vs real replay] unfixed-partial: NO: flip_replay_changed: 0 vs 15" in lines


# --------------------------------------------------------------------------------------
# DebugMode's Triton hook and the RecordingMode patch (CPU torch)
# --------------------------------------------------------------------------------------

def test_launch_recorder_records_without_sync():
    torch = pytest.importorskip("torch")
    dm = pytest.importorskip("torch.utils._debug_mode")
    if not hasattr(dm.DebugMode, "record_triton_kernel"):
        pytest.skip("this torch's DebugMode has no Triton hook")
    rec = checks.make_launch_recorder()
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
    with checks.recording_mode_ignores_compile_internals():
        assert RecordingMode.ignore_compile_internals() is True
    assert RecordingMode.__dict__.get("ignore_compile_internals") is before
    assert RecordingMode.ignore_compile_internals() is native
    with checks.recording_mode_ignores_compile_internals(False):
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

    notes = checks.Notes(key, table_dir=tmp_path, echo=False)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    new = torch.randperm(512)
    fig = checks.measure(notes, key, model=model, fn=fn, x=x, driver=FakeDriver(model, x),
                      compiled=fn is not model, patch=patch, use_hook=True,
                      rebind=lambda: model.set_perm(new), eager_fn=model,
                      capture_fn=checks.emulated_capture_keep,
                      memory_fn=lambda: pd.DataFrame(columns=["data_ptr", "nbytes", "label"]))
    return fig, notes


def test_measure_rehearsal_eager_on_cpu(tmp_path):
    pytest.importorskip("torch")
    model = checks.make_small_net("cpu")
    fig, notes = _rehearse(model, model, "small-net-eager", False, tmp_path)
    c = fig["coverage"]
    assert (c["owned"], c["owned_attributed"], c["kernels"]) == (7, 7, 8)
    assert c["pointers"] == c["attributed"] == 8
    assert fig["triton_launches_hooked"] == 0 and fig["triton_kernel_nodes"] == 0
    assert fig["replay_eq_eager_before_rebind"] == 8
    assert fig["stale_owners"] == ["act_perm.keywords['index']"]
    assert fig["replay_eq_eager_after_rebind"] == 0 and fig["replay_changed_by_rebind"] == 0
    assert (tmp_path / "gpu_coverage_kernels_small-net-eager.csv").exists()
    assert any("replay==eager before the rebind 8/8" in ln for ln in notes.lines)


@pytest.mark.slow
def test_measure_rehearsal_compiled_on_cpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    torch._dynamo.reset()
    model = checks.make_small_net("cpu")
    fig, _ = _rehearse(model, torch.compile(model, dynamic=False), "small-net-compiled", True,
                       tmp_path)
    c = fig["coverage"]
    # the compiled region's call is recorded with its inputs (issue 14, graphtrace/compiled.py):
    # what the fused kernels read is attributed too, and the rebound perm is found
    assert (c["owned"], c["owned_attributed"]) == (7, 7)
    assert c["unseen_owners"] == ""
    assert fig["op_names"][0] == "aten::addmm.out"
    assert [re.sub(r"\d+$", "N", op) for op in fig["op_names"][1:]] == ["compiled::graphN"]
    assert fig["stale_like_edges"] == 1
    torch._dynamo.reset()


def test_probes_never_raise():
    pytest.importorskip("torch")
    probes = checks.probe_torch_features()
    assert set(probes) == {"cudagraph_keep_graph", "debugmode_triton_hook", "inductor_calls_hook",
                           "dynamo_dispatch_mode_rule", "cudagraph_get_graph_data"}
    assert all(isinstance(ok, bool) and isinstance(detail, str) for ok, detail in probes.values())


# --------------------------------------------------------------------------------------
# slower: torch.compile on the CPU (Inductor's C++ kernels)
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_compile_cpu_blind_spot():
    pytest.importorskip("torch")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    import torch

    cases = checks.compile_cpu_cases(checks.Notes(echo=False))
    torch._dynamo.reset()
    small = cases["small-net-cpu"]
    assert any("act_perm" in o for o in small["eager"]["stale_owners"])
    from graphtrace.recorder import RecordingMode

    if not RecordingMode.ignore_compile_internals():
        # as is: Dynamo runs the compiled model eagerly under the recorder, and keeps doing so
        assert small["compiled-asis"]["fell_back_to_eager"] is True
        assert small["compiled-asis"]["ops_per_call_after"] == small["eager"]["ops"]
    else:  # the recorder declares ignore_compile_internals: compiled code stays compiled
        assert small["compiled-asis"]["fell_back_to_eager"] is False
    # compiled code kept (patched mode): each compiled region's call is recorded with its
    # inputs (graphtrace/compiled.py), so nothing eager found is missed
    assert small["compiled-patched"]["owned_missing_vs_eager"] == []
    assert small["compiled-patched"]["stale_missed_vs_eager"] == []
    demo = cases["demo-unfixed-lambda-cpu"]
    ops = demo["compiled-patched"]["op_names"]
    assert "graphtrace::machete_mm" in ops and any(op.startswith("compiled::") for op in ops)
    assert demo["compiled-patched"]["stale_missed_vs_eager"] == []


# --------------------------------------------------------------------------------------
# CUDA: the full run
# --------------------------------------------------------------------------------------

def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(not _cuda(), reason="needs CUDA: torch.cuda.is_available() is False")
def test_full_run_on_cuda(tmp_path):
    proc, _ = run_script("--out", str(tmp_path), timeout=1000)
    block = results(tmp_path, ".txt").read_text()
    assert proc.returncode == 0, block[-6000:]
    assert f"== summary: {N_GPU_TESTS} passed, 0 skipped, 0 failed; RESULT: PASS ==" in block
    for variant in VARIANTS:
        for scenario in ("new-weights", "same-weights"):
            assert (f"verdicts equal [emulated[cpu] vs cuda-graphs] {variant} {scenario}: yes"
                    in block)
        assert f"replay agrees [emulated replay vs real replay] {variant}: yes" in block
    assert "unfixed-partial: act order flipped in place: eager rows changed 15/15, replayed rows changed 0/15" in block
