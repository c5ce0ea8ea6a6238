"""Check that the installed vLLM is what graphtrace's release table says it is.

``check()`` compares a row of `graphtrace.vllm.releases` with the vLLM the process imports
and returns one line per broken expectation, each naming its target (empty: the contract
holds). It only imports vLLM's modules and reads their source, so it runs for any release
on a machine without a GPU (the CUDA builds' ``vllm._C`` never loads there; nothing here
needs it). Where a fact can only be read from the source (attributes a runner sets in
methods that need a device), it is read with ``ast``.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from graphtrace import targets
from graphtrace.vllm.releases import Hook, Release, release

__all__ = ["check", "check_hooks", "check_runners", "check_capture_sites", "check_fix_api",
           "check_reload_units", "scan_capture_sites", "assigned_attrs", "reload_callers"]

CAPTURE_RE = re.compile(r"torch\.cuda\.graph\(|\.capture_begin\(")
BYPASS_RE = re.compile(r"make_graphed_callables|_C\._CUDAGraph|cudaStreamBeginCapture")


def check(rel: Release | None = None) -> list[str]:
    """Every broken expectation of ``rel`` (None: the installed vLLM's row)."""
    rel = rel or release()
    return (_check_version(rel) + check_hooks(rel.hooks) + _check_hook_table(rel)
            + check_runners(rel.runners) + check_capture_sites(rel) + check_fix_api(rel)
            + check_reload_units(rel))


def _check_version(rel: Release) -> list[str]:
    import vllm

    got = ".".join(vllm.__version__.split("+")[0].split(".")[:2])
    return [] if got == rel.version else [f"vllm: installed {vllm.__version__}, the row is "
                                          f"for {rel.version}"]


assigned_attrs = targets.assigned_attrs  # the engine-neutral part: graphtrace/targets.py


def check_hooks(hook_list) -> list[str]:
    """Each hook target exists, accepts the call its wrapper passes on (`Hook.call`), and
    is an async generator function where the wrapper streams its result."""
    problems = []
    for hook in hook_list:
        fn, problem = targets.resolve(hook.module, hook.qualname)
        if problem:
            problems.append(problem)
            continue
        problems += _check_call(hook, fn)
    return problems


def _check_call(hook: Hook, fn) -> list[str]:
    args, kwargs = hook.call
    problems = targets.check_call(hook.target, fn, args, kwargs, method="." in hook.qualname)
    if problems:
        return problems
    if hook.async_gen and not inspect.isasyncgenfunction(fn):
        return [f"{hook.target}: no longer an async generator function (graphtrace streams "
                "its result)"]
    return []


def _check_hook_table(rel: Release) -> list[str]:
    """graphtrace.vllm.hooks (what is wrapped) and the release row (what is checked) agree."""
    from graphtrace.vllm import hooks

    wrapped = set(hooks.targets())
    listed = {h.target for h in rel.hooks}
    return [f"{t}: wrapped by graphtrace.vllm.hooks but not in the {rel.version} row"
            for t in sorted(wrapped - listed)] + [
        f"{t}: in the {rel.version} row but not wrapped by graphtrace.vllm.hooks"
        for t in sorted(listed - wrapped)]


def check_runners(runners) -> list[str]:
    """Each runner class sets the attributes the runner view exposes as its input buffers,
    and each holder class (V2's ``InputBuffers``, ``BlockTables``) its tensors."""
    problems = []
    for runner in runners:
        problems += targets.check_attrs(runner.cls, runner.attrs, "the runner view's input buffers")
        for attr, holder, tensors in runner.holders:
            problems += targets.check_attrs(holder, tensors, f"read through runner.{attr}")
    return problems


def scan_capture_sites(root: Path) -> tuple[dict[str, str], list[str]]:
    """(file -> "torch.cuda.graph" | "capture_begin", files that capture some other way)."""
    found, bypass = {}, []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text(errors="replace")
        code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        rel = f.relative_to(root).as_posix()
        if CAPTURE_RE.search(code):
            found[rel] = "capture_begin" if ".capture_begin(" in code else "torch.cuda.graph"
        if BYPASS_RE.search(code):
            bypass.append(rel)
    return found, bypass


def check_capture_sites(rel: Release) -> list[str]:
    import vllm

    found, bypass = scan_capture_sites(Path(vllm.__file__).parent)
    out = [f"vllm/{f}: a capture site not in the {rel.version} row ({how})"
           for f, how in sorted(found.items()) if rel.capture_sites.get(f) != how]
    out += [f"vllm/{f}: a capture site of the {rel.version} row is gone"
            for f in sorted(rel.capture_sites) if f not in found]
    out += [f"vllm/{f}: captures without CUDAGraph.capture_begin" for f in bypass]
    return out


def _fact(key: str):
    """The installed vLLM's answer to one ``fix_api`` key."""
    if key == "replace_parameter.prefer_copy":
        fn, _ = targets.resolve("vllm.model_executor.utils", "replace_parameter")
        return fn is not None and "prefer_copy" in inspect.signature(fn).parameters
    if key == "refill_derived":
        return targets.resolve("vllm.model_executor.utils", "refill_derived")[0] is not None
    if key == "keep_constants":
        cls, _ = targets.resolve("vllm.model_executor.layers.fused_moe.modular_kernel",
                          "FusedMoEExperts")
        return cls is not None and "keep_constants" in cls.__dict__
    if key == "direct_reload":
        return targets.resolve("vllm.model_executor.model_loader.reload.direct",
                        "finish_direct_reload")[0] is not None
    if key == "engine_core_output_error":
        cls, _ = targets.resolve("vllm.v1.engine", "EngineCoreOutput")
        return cls is not None and "error" in getattr(cls, "__struct_fields__", ())
    raise KeyError(key)


def check_fix_api(rel: Release) -> list[str]:
    """The facts a fix text depends on hold (``Release.fix_api``), and the direct-reload
    entry points exist where the row names them."""
    out = [f"fix_api[{k!r}]: the {rel.version} row says {v}, the installed vLLM {not v}"
           for k, v in rel.fix_api.items() if _fact(k) != v]
    for target in rel.direct_reload:
        out += [p for p in [targets.resolve(*target.split(":"))[1]] if p]
    return out



RELOAD_CALLS = ("start_reload", "finish_reload", "begin_direct_reload", "finish_direct_reload")


def reload_callers(root: Path) -> dict[str, tuple[str, ...]]:
    """file -> the functions in it that call a reload begin/finish (`RELOAD_CALLS`)."""
    out: dict[str, tuple[str, ...]] = {}
    for f in sorted(root.rglob("*.py")):
        text = f.read_text(errors="replace")
        if not any(f"{name}(" in text for name in RELOAD_CALLS):
            continue
        callers = set()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    called = getattr(node.func, "id", getattr(node.func, "attr", ""))
                    if called in RELOAD_CALLS:
                        callers.add(fn.name)
        if callers:
            out[f.relative_to(root).as_posix()] = tuple(sorted(callers))
    return out


def check_reload_units(rel: Release) -> list[str]:
    """Direct reload's begin/finish run only where the row says (Note [direct reload] in
    graphtrace/vllm/releases.py); a new caller fails naming it."""
    if not rel.reload_callers:
        return []
    import vllm

    found = reload_callers(Path(vllm.__file__).parent)
    return [f"vllm/{f}: {', '.join(fns)} begins or finishes a reload outside the {rel.version} "
            f"row's update units (expected {', '.join(rel.reload_callers.get(f, ())) or 'none'})"
            for f, fns in sorted(found.items()) if rel.reload_callers.get(f) != fns] + [
        f"vllm/{f}: no longer begins or finishes a reload ({rel.version} row)"
        for f in sorted(rel.reload_callers) if f not in found]
