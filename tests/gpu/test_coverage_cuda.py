"""Pointer-argument coverage of real captured graphs: every pointer-sized kernel argument
that falls inside known memory (read from the kernel nodes through libcuda), and whether
graphtrace attributed it. Eager models are the method's baseline; torch.compile'd ones show
what Inductor's Triton kernels (launched without the dispatcher) hide, with DebugMode's
Triton hook as a second source."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def driver():
    from graphtrace.cuda_nodes import CudaDriver

    return CudaDriver()


def _small_net(checks):
    import torch

    torch.manual_seed(0)
    model = checks.make_small_net("cuda")
    x = torch.randn(8, 256, device="cuda")
    new = torch.randperm(512, device="cuda")
    return model, x, lambda: model.set_perm(new)


@pytest.mark.gpu_timeout(180)
def test_coverage_small_net_eager(checks, notes, driver):
    notes.line(f"libcuda driver API {driver.version_text}; cuFuncGetParamInfo "
               f"{'available: arguments read at their sizes' if driver.cuFuncGetParamInfo else 'MISSING: argument blocks scanned conservatively (8-byte words)'}")
    model, x, rebind = _small_net(checks)
    f = checks.measure(notes, "small-net-eager", model=model, fn=model, x=x, driver=driver,
                       compiled=False, patch=False, use_hook=False, rebind=rebind)
    notes.figure("case", f)
    c = f["coverage"]
    assert c["owned"] > 0 and c["owned_attributed"] == c["owned"], c
    assert any("act_perm" in o for o in f["stale_owners"]), f["stale_owners"]


@pytest.mark.gpu_timeout(180)
def test_coverage_demo_eager(checks, notes, driver):
    from graphtrace.demo.model import DemoModel
    from graphtrace.demo.reload import reload

    model = DemoModel("unfixed-partial", n_layers=checks.LAYERS, seed=0, device="cuda",
                      reload_backend=checks.BACKEND)
    x = model.make_input(4)

    def rebind():
        reload(model, model.make_checkpoint(1, 2), backend=checks.BACKEND)

    f = checks.measure(notes, "demo-unfixed-partial-eager", model=model, fn=model, x=x,
                       driver=driver, compiled=False, patch=False, use_hook=False, rebind=rebind)
    notes.figure("case", f)
    c = f["coverage"]
    assert c["owned"] > 0 and c["owned_attributed"] == c["owned"], c


def _compiled_small_net(checks, notes, driver, key: str, patch: bool) -> dict:
    import torch

    torch._dynamo.reset()  # a frame Dynamo once skipped stays skipped
    model, x, rebind = _small_net(checks)
    compiled = torch.compile(model, dynamic=False)
    t = time.perf_counter()
    with torch.no_grad():
        compiled(x)
        compiled(x)
    torch.cuda.synchronize()
    notes.line(f"{key}: compiled and warmed up in {time.perf_counter() - t:.1f} s; "
               f"{checks.dispatched_ops(compiled, x)} ops reach the dispatcher per call "
               f"(eager {checks.dispatched_ops(model, x)})")
    f = checks.measure(notes, key, model=model, fn=compiled, x=x, driver=driver, compiled=True,
                       patch=patch, use_hook=True, rebind=rebind, eager_fn=model)
    f["ops_per_call_after"] = checks.dispatched_ops(compiled, x)
    f["ops_per_call_eager"] = checks.dispatched_ops(model, x)
    notes.figure("case", f)
    return f


@pytest.mark.gpu_timeout(300)
def test_coverage_small_net_compiled(checks, notes, driver):
    """RecordingMode patched to ignore compile internals: compiled code stays compiled."""
    probes = checks.probe_torch_features()
    notes.line("DebugMode Triton hook: " + ("present" if probes["debugmode_triton_hook"][0] else
                                            "MISSING") + f" ({probes['debugmode_triton_hook'][1]})")
    f = _compiled_small_net(checks, notes, driver, "small-net-compiled", patch=True)
    c = f["coverage"]
    notes.line(f"small-net-compiled: model-owned pointers attributed by the dispatcher "
               f"{c['owned_attributed']}/{c['owned']}; unseen owners: {c['unseen_owners'] or '-'}")
    if f.get("triton_launches_hooked") is not None:
        notes.line(f"small-net-compiled: with the DebugMode hook: {c['attributed_with_hook']}/"
                   f"{c['pointers']} pointers attributed")
    blind = f["stale_like_edges"] == 0 and f["replay_eq_eager_after_rebind"] < f["rows"]
    notes.line(f"small-net-compiled: after rebinding act_perm: stale-like edges "
               f"{f['stale_like_edges']}, replay==eager {f['replay_eq_eager_after_rebind']}/{f['rows']}"
               f" -> {'a stale read graphtrace does NOT flag (blind spot)' if blind else 'see figures'}")
    assert f["triton_kernel_nodes"] > 0, "no Triton kernel in the graph"
    # issue 14 (graphtrace/compiled.py): the compiled region's call and each Triton launch
    # are recorded as ops, so the fused kernels' owned reads are attributed
    ops = f["op_names"]
    notes.line(f"small-net-compiled: recorded compiled regions "
               f"{[o for o in ops if o.startswith('compiled::')]}, Triton launches "
               f"{[o for o in ops if o.startswith('triton::')]}")
    assert any(o.startswith("compiled::") for o in ops), ops
    assert any(o.startswith("triton::") for o in ops), ops
    assert c["owned_attributed"] == c["owned"], c


@pytest.mark.gpu_timeout(300)
def test_coverage_small_net_compiled_as_is(checks, notes, driver):
    """graphtrace's RecordingMode as shipped: does the compiled model run compiled under it?"""
    f = _compiled_small_net(checks, notes, driver, "small-net-compiled-asis", patch=False)
    ran = "compiled code" if f["triton_kernel_nodes"] else "EAGERLY (Dynamo skipped the frame)"
    notes.figure("ran", ran)
    notes.line(f"small-net-compiled-asis: under graphtrace's RecordingMode the compiled model "
               f"ran {ran}; afterwards, outside any trace, {f['ops_per_call_after']} ops reach "
               f"the dispatcher per call (eager {f['ops_per_call_eager']})")
    assert f["rows"] == 8 and f["replay_eq_eager_before_rebind"] == 8


@pytest.mark.gpu_timeout(420)
def test_coverage_demo_compiled(checks, notes, driver):
    """The demo model (unfixed-lambda) compiled; a reload rebinds the permutation."""
    import torch

    from graphtrace.demo.model import DemoModel
    from graphtrace.demo.reload import reload

    torch._dynamo.reset()
    model = DemoModel("unfixed-lambda", n_layers=checks.LAYERS, seed=0, device="cuda",
                      reload_backend=checks.BACKEND)
    compiled = torch.compile(model, dynamic=False)
    x = model.make_input(4)
    t = time.perf_counter()
    with torch.no_grad():
        compiled(x)
        compiled(x)
    torch.cuda.synchronize()
    notes.line(f"demo-unfixed-lambda-compiled: compiled and warmed up in "
               f"{time.perf_counter() - t:.1f} s")

    def rebind():
        reload(model, model.make_checkpoint(1, 2), backend=checks.BACKEND)

    f = checks.measure(notes, "demo-unfixed-lambda-compiled", model=model, fn=compiled, x=x,
                       driver=driver, compiled=True, patch=True, use_hook=True, rebind=rebind,
                       eager_fn=model)
    notes.figure("case", f)
    perm_flagged = [o for o in f["stale_owners"] if "act_perm" in o]
    notes.line(f"demo-unfixed-lambda-compiled: act_perm reads flagged after the reload: "
               f"{len(perm_flagged)}; replay==eager {f['replay_eq_eager_after_rebind']}/{f['rows']}")
    assert f["replay_eq_eager_before_rebind"] == f["rows"]
