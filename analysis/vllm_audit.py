"""Audit: what graphtrace finds in a real vLLM 0.32 on CPU, with tiny local models.

Each case builds a tiny checkpoint, starts an in-process ``LLM`` under
``graphtrace.vllm.trace_llm``, records emulated graphs of the model forward (the first decode
step of a generate, and vLLM's own dummy decode run), reloads through
``collective_rpc("reload_weights")`` and diffs. Tables go to
``analysis/results/vllm_audit.md``.

    .venv-vllm/bin/python analysis/vllm_audit.py             # all cases (~2-3 min on 2 cores)
    .venv-vllm/bin/python analysis/vllm_audit.py --no-compile
    .venv-vllm/bin/python analysis/vllm_audit.py --reports DIR   # also keep the report folders
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import write_results
from graphtrace.vocab import STALE_VERDICTS, VERDICTS

__all__ = ["CASES", "md_table", "run_case", "case_section", "main"]

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "vllm_audit.md"

CASES = {
    "llama-fp32 / changed weights": dict(kind="llama", dtype="float32", reload="changed"),
    "llama-fp32 / same weights (from disk)": dict(kind="llama", dtype="float32", reload="same"),
    "gptq-fp16 (CPUWNA16) / changed weights": dict(kind="gptq", dtype="float16", reload="changed"),
    "llama-fp32 torch.compile / changed weights": dict(kind="llama", dtype="float32",
                                                       reload="changed", compile=True),
}


def md_table(df, index: bool = False) -> str:
    """A pandas frame as a GitHub markdown table (no tabulate dependency)."""
    import pandas as pd

    if index:
        df = df.reset_index()
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = []
        for v in row:
            s = "" if (v is None or (not isinstance(v, str) and pd.isna(v))) else str(v)
            cells.append(s.replace("|", "\\|").replace("\n", " "))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_case(name: str, spec: dict, workdir: Path, reports: Path | None) -> dict:
    from vllm import LLM

    import graphtrace.vllm as gv
    from graphtrace.vllm import tiny

    model_dir = workdir / spec["kind"]
    if not (model_dir / "config.json").exists():
        (tiny.make_tiny_llama if spec["kind"] == "llama" else tiny.make_tiny_gptq)(model_dir)
    kw = tiny.engine_kwargs(model_dir, dtype=spec["dtype"])
    if spec.get("compile"):
        kw["enforce_eager"] = False
    res: dict = {"name": name, "spec": spec}
    t0 = time.perf_counter()
    with gv.trace_llm() as vt:
        llm = LLM(**kw)
        res["t_engine"] = time.perf_counter() - t0
        vt.attach(llm)
        res["before"] = vt.generate(max_tokens=4)
        t = time.perf_counter()
        with vt.capture("decode", skip=1):
            vt.generate(max_tokens=2)
        vt.capture_dummy("dummy_decode", 4)
        res["t_capture"] = time.perf_counter() - t
        t = time.perf_counter()
        if spec["reload"] == "changed":
            vt.reload(tiny.checkpoint_weights(model_dir, tiny.perturbed(seed=1)))
        else:
            vt.reload()
        res["t_reload"] = time.perf_counter() - t
        res["after"] = vt.generate(max_tokens=4)
        t = time.perf_counter()
        report = vt.diff()
        res["t_diff"] = time.perf_counter() - t
        model = vt.model
        res["params"] = [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.numel())
                         for n, p in model.named_parameters()]
        res["buffers"] = [(n, tuple(b.shape)) for n, b in model.named_buffers()]
    if spec.get("compile") and spec["reload"] == "changed":
        # reference: a fresh eager engine on the changed checkpoint
        changed = tiny.write_changed_checkpoint(model_dir, workdir / f"{spec['kind']}-changed",
                                                tiny.perturbed(seed=1))
        ref = LLM(**tiny.engine_kwargs(changed, dtype=spec["dtype"]))
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True)
        outs = ref.generate([{"prompt_token_ids": p} for p in tiny.PROMPTS], sp, use_tqdm=False)
        res["fresh_after"] = [list(o.outputs[0].token_ids) for o in outs]
        del ref
    res["report"] = report
    if reports is not None:
        folder = reports / name.replace(" / ", "__").replace(" ", "_").replace("(", "").replace(")", "")
        report.to_csv(folder)
        res["folder"] = str(folder)
    del llm, vt
    gc.collect()
    return res


def case_section(res: dict) -> str:
    import pandas as pd

    rep = res["report"]
    e = rep.edges.copy()
    for c in ("verdict", "owners", "owner_kinds", "ops", "args", "graph", "impact", "origin"):
        e[c] = e[c].astype(object)
    out = [f"### {res['name']}", ""]
    vm = rep.meta.get("vllm", {})
    out.append(f"Engine: `{vm.get('model_class')}` on `{vm.get('worker')}`/`{vm.get('model_runner')}`, "
               f"dtype {vm.get('dtype')}, quantization `{vm.get('quantization') or 'none'}`, "
               f"compilation mode {vm.get('compilation_mode')}, cudagraph mode {vm.get('cudagraph_mode')}.")
    changed = res["after"] != res["before"]
    line = f"Outputs changed by the reload: **{changed}**"
    if "fresh_after" in res:
        line += (f"; after the reload equal to a fresh engine on the new checkpoint: "
                 f"**{res['after'] == res['fresh_after']}**")
    out += [line + ".", ""]
    out.append(f"Times (s): engine start {res['t_engine']:.1f}, two captures {res['t_capture']:.2f}, "
               f"reload {res['t_reload']:.2f}, diff {res['t_diff']:.2f}.")
    out.append("")
    ct = pd.crosstab(e["graph"], e["verdict"])
    out += ["Edges by graph and verdict:", "", md_table(ct, index=True), ""]
    owned = e[e["owner_kinds"] != ""]
    if len(owned):
        kt = pd.crosstab(owned["owner_kinds"], owned["verdict"])
        out += ["Owned edges by owner kind:", "", md_table(kt, index=True), ""]
    stale = e[e["verdict"].isin([*STALE_VERDICTS, "orphaned"])]
    if len(stale):
        t = (stale[stale["graph"] == stale["graph"].iloc[0]]
             [["ops", "args", "owners", "verdict", "impact"]])
        out += [f"Stale-like edges of graph `{stale['graph'].iloc[0]}` "
                f"({len(stale)} over all graphs):", "", md_table(t), ""]
    else:
        out += ["No stale-like (stale, dangling, diverged, unrefreshed) or orphaned edge.", ""]
    # parameter coverage: is each registered tensor read by a graph, and with which verdict?
    read = {}
    for owners, verdict in zip(e["owners"], e["verdict"]):
        for o in str(owners).split("; "):
            if o:
                read[o] = verdict
    spots = {s["path"]: s["kind"] for s in vm.get("blind_spots", []) if s["kind"] != "forward_context"}
    rows = []
    for n, shape, dtype, numel in res["params"]:
        if n in read:
            status = f"read by graph: {read[n]}"
        elif n in spots:
            status = f"blind spot: {spots[n]}"
        else:
            status = "not read by the captured forward"
        rows.append((status, n, str(shape), dtype))
    cov = pd.DataFrame(rows, columns=["status", "parameter", "shape", "dtype"])
    summary = cov.groupby("status").size().rename("parameters").reset_index()
    out += ["Registered parameters (vLLM FQNs) and what the graphs read of them:", "",
            md_table(summary), ""]
    notread = cov[~cov["status"].str.startswith("read")]
    if len(notread):
        out += ["Not read directly:", "", md_table(notread[["parameter", "shape", "dtype", "status"]]), ""]
    attr = e[(e["owner_kinds"] == "attribute")]
    if len(attr):
        out += [f"Reads owned only through attribute paths: {len(attr)} edges "
                f"({', '.join(sorted(set(attr['args'])))}).", ""]
    ops = rep.accesses.groupby("op", observed=True).size().sort_values(ascending=False)
    out += ["Ops recorded (accesses per op, all graphs): " +
            ", ".join(f"`{k}` {v}" for k, v in ops.items()) + ".", ""]
    if rep.blind_spots:
        kinds = pd.Series([s["kind"] for s in vm.get("blind_spots", [])]).value_counts()
        out += ["Blind spots in the report: " + ", ".join(f"{k} {v}" for k, v in kinds.items()) + ".",
                ""]
    if rep.meta.get("n_errors"):
        out += [f"Recorder errors: {rep.meta['n_errors']}.", ""]
    if "folder" in res:
        out += [f"Report folder: `{res['folder']}`.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile case (~45 s)")
    ap.add_argument("--reports", type=Path, default=None, help="also write each report folder here")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    from graphtrace.vllm import tiny

    tiny.set_engine_env()
    import torch
    import vllm

    workdir = Path(tempfile.mkdtemp(prefix="vllm-audit-"))
    t_all = time.perf_counter()
    results = []
    for name, spec in CASES.items():
        if spec.get("compile") and args.no_compile:
            continue
        print(f"[vllm_audit] {name} ...", file=sys.stderr, flush=True)
        results.append(run_case(name, spec, workdir, args.reports))
    total = time.perf_counter() - t_all

    lines = ["# graphtrace audit of vLLM 0.32 on CPU", "",
             f"Generated by `analysis/vllm_audit.py` (vllm {vllm.__version__}, torch {torch.__version__}, "
             f"Python {platform.python_version()}, {platform.machine()}); total {total:.0f} s.",
             "Tiny Llama (hidden 128, 2 layers, 4 heads / 2 KV heads, head size 32, vocab 512), random "
             "weights; GPTQ: the same model quantized to 4 bit (group 32, symmetric, desc_act off).",
             "Graphs are emulated captures of `model.forward` (CPU has no CUDA graphs): `decode` is the "
             "first decode step of a 3-prompt generate, `dummy_decode` vLLM's own dummy run (4 tokens). "
             "The emulated graphs stay alive like capture artifacts, so a moved owner reads `stale`.",
             "", "## Summary", ""]
    import pandas as pd

    rows = []
    for r in results:
        e = r["report"].edges
        v = e["verdict"].astype(str).value_counts()
        rows.append((r["name"], len(e), *(v.get(x, 0) for x in VERDICTS),
                     len(r["report"].blind_spots), r["after"] != r["before"]))
    lines += [md_table(pd.DataFrame(rows, columns=[
        "case", "edges", *VERDICTS, "blind spots", "outputs changed"])), ""]
    lines += ["## Findings", "",
              "- Plain float32 linear layers: vLLM prepacks the weight into a oneDNN handle and "
              "registers an empty `weight`; graphs read the 0-d `handler_tensor` held in the "
              "closure of `layer.cpu_linear`. Every reload (changed or identical weights) builds a "
              "new handle in a new lambda and releases the old one: those edges are `stale` "
              "(`manifest`: the pointer differs). A graph captured before the reload would call "
              "oneDNN with a released handle. The packed weight itself is invisible (blind spot).",
              "- Registered parameters and buffers the forward reads directly (norms, embedding, "
              "rotary cache, GPTQ `qweight`/`scales`) are `stable`: the layerwise reload copies new "
              "values into their storages.",
              "- GPTQ through `CPUWNA16LinearKernel` is reload-safe: no stale edge.",
              "- KV-cache reads/writes happen inside `vllm::unified_attention_with_output` / "
              "`unified_kv_cache_update`, fetched by layer name from the forward context: not "
              "recorded, reported as a blind spot.",
              ]
    owner_paths = set()
    for r in results:
        owner_paths |= set(r["report"].owners["path"].astype(str))
    if not any(p.startswith("runner.input_ids") for p in owner_paths):
        lines.append(
            "- The runner's `input_ids` buffer read is missing: under `torch.inference_mode` "
            "`aten::to.dtype` (int32 to int64) reaches the recorder undecomposed and its "
            "`Tensor(a) self` is classified as a view (a recorder gap, not a vLLM property).")
    else:
        lines.append("- The runner's `input_ids` buffer is recorded as a read and owned "
                     "(`runner.input_ids...`).")
    comp = [r for r in results if r["spec"].get("compile")]
    if comp:
        r = comp[0]
        ops = sorted(set(r["report"].accesses["op"].astype(str)))
        lines.append(
            f"- torch.compile on CPU ({r['report'].meta['vllm'].get('compilation_mode')}): the "
            f"dispatcher sees only {', '.join(f'`{o}`' for o in ops)}; Inductor's C++ kernels "
            "(norms, rotary, activations) are invisible and reported as a `compiled` blind spot. "
            "The handle edges are still `stale` for the emulated graph, while the real compiled "
            "engine after the reload produced the same tokens as a fresh engine on the new "
            f"checkpoint: **{r.get('fresh_after') == r['after']}** (the compiled code fetches "
            "the handle from `cpu_linear` on every call; only a captured graph would keep the old one).")
    lines += ["", "## Cases", ""]
    for r in results:
        lines += [case_section(r), ""]
    write_results(args.out, "\n".join(lines).rstrip() + "\n")
    print(f"[vllm_audit] wrote {args.out} in {total:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
