"""guard.check() against t.diff() on a model shaped like an 80-layer Llama 70B, 67 graphs.

Model: the module tree of Hugging Face's LlamaForCausalLM for Llama-3-70B (``model.
embed_tokens``, 80 ``model.layers.{i}`` each with ``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``; ``model.norm``,
``model.rotary_emb.inv_freq``, ``lm_head``): the same modules and the same 9 parameters per
layer (no biases), 723 parameters in all, with tiny tensors (hidden size 8: the shapes do not
change what the guard or the diff do per storage). Each layer's attention also keeps a
kernel-like holder (a tensor in a ``functools.partial``), as vLLM's quant methods do. 67
graphs are captured, one per decode batch size 1..67 (vLLM's default capture list has 67
sizes), each a full forward. Then a same-weights reload (values copied into the registered
tensors, holders untouched) and: ``guard.check()`` (median of many runs) against
``t.diff()`` (median of a few) on the same trace, and the check of a reload that rebinds one
holder (detected by both).

    python analysis/bench_guard.py [--layers 80] [--graphs 67] [--out analysis/results/bench_guard.txt]
    python analysis/bench_guard.py --quick      # 4 layers, 3 graphs (tests)
    python analysis/bench_guard.py --norm layernorm|llama-rms [--sizes vllm]
    python analysis/bench_guard.py --sizes vllm [--emulate 0|1] \
        [--out analysis/results/bench_guard_vllm_sizes.txt]

``--sizes vllm``: vLLM's default decode capture sizes instead (1, 2, 4, 8..248 by 8, 256..512
by 16: 51 sizes), each captured twice, as FULL and PIECEWISE graphs (here both are the whole
forward, labelled apart: 102 captures, batch sizes up to 512), with ``gt.capture(emulate=...)``
(default 1, the CPU default: replayable emulated graphs). Also printed: the process's peak
resident memory (the model, the trace and every graph) and the capture time.

``--freshness``: freshness against identity only (issue 24's goal: at most 2x). A process
step inside the trace derives each layer's kernel scale from its ``q_proj.weight`` (the graphs
read 80 derived storages, lineage records them), the reload copies the same weights and
recomputes the scales in place (clean); the same run is made with lineage on (the guard checks
identity and freshness) and off (identity only), and the clean checks' medians compared:

    python analysis/bench_guard.py --freshness [--layers 80] [--graphs 67]

``--norm layernorm`` (nn.LayerNorm) / ``llama-rms`` (transformers' LlamaRMSNorm): norm modules
that hold their epsilon as a float, which every graph bakes in (issue 39: 161 holders x 67
graphs of baked-scalar records; vLLM's RMSNorm passes its epsilon as a float too).

Exit status 1 when the full-size run misses the targets: check <= 10 ms (with ``--norm``
layernorm or llama-rms: <= 1 ms clean, <= 5 ms after the update) and >= 50x faster than
diff (with ``--freshness``: the ratio at most 2).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import resource
import statistics
import sys
import time

import torch
from bench_scale import frames_alone
from torch import nn

import graphtrace as gt
from _common import revision, rss, show

LAYER_PARAMS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight",
                "post_attention_layernorm.weight")


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d, d, bias=False) for _ in range(4))
        # what a quant method keeps outside the registered parameters
        self.kernel_scale = functools.partial(torch.mul, other=torch.ones(d))

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        att = torch.softmax(q @ k.t(), dim=-1)
        return self.o_proj(self.kernel_scale(att @ v))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, 2 * d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def llama_rms_norm(d: int) -> nn.Module:
    """transformers' LlamaRMSNorm: holds its epsilon as a float (`variance_epsilon`)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return LlamaRMSNorm(d, eps=1e-5)


# --norm: the layers' norm modules. `rms` holds no float (its epsilon is a literal in
# forward); `layernorm` (nn.LayerNorm, `eps`) and `llama-rms` (transformers' LlamaRMSNorm,
# `variance_epsilon`) each hold one, which every graph bakes in: a `baked scalar` holder per
# norm module, the same in every graph (issue 39: what vLLM's RMSNorm does too)
NORMS = {"rms": RMSNorm, "layernorm": nn.LayerNorm, "llama-rms": llama_rms_norm}
NORM = RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.self_attn = Attention(d)
        self.mlp = MLP(d)
        self.input_layernorm = NORM(d)
        self.post_attention_layernorm = NORM(d)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(d // 2), persistent=False)


class LlamaModel(nn.Module):
    def __init__(self, layers: int, d: int, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(layers))
        self.norm = NORM(d)
        self.rotary_emb = Rotary(d)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, layers: int = 80, d: int = 8, vocab: int = 32):
        super().__init__()
        self.model = LlamaModel(layers, d, vocab)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


# vLLM 0.32's default cudagraph capture sizes up to 512 (vllm/config/vllm.py:2304: 1, 2, 4, then
# multiples of 8 below 256, then of 16 up to 512)
VLLM_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def same_weights_reload(model: nn.Module) -> None:
    """What vLLM's layerwise reload does to registered tensors: copy into their storages."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.detach().clone())


def derive_scales(model: nn.Module) -> None:
    """A process step: each layer's kernel scale derived from its q_proj weight."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kernel_scale = functools.partial(torch.mul,
                                                  other=attn.q_proj.weight.abs().amax(0))


def rederive_in_place(model: nn.Module) -> None:
    """The reload's process step: the derived scales recomputed into their own storages."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kernel_scale.keywords["other"].copy_(attn.q_proj.weight.abs().amax(0))


def freshness_ratio(args, captures) -> int:
    """guard.check() with freshness (lineage on) against identity only (lineage off)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    medians, derived = {}, {}
    for lineage in (True, False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(args.layers).eval()
        with torch.no_grad(), gt.trace(model, lineage=lineage) as t:
            derive_scales(model)
            graphs = []
            for label, bs in captures:
                with gt.capture(label, emulate=bool(args.emulate)) as g:
                    model(torch.arange(bs) % 32)
                graphs.append(g)
        guard = t.guard()
        derived[lineage] = len(t.lineage.captured) if t.lineage is not None else 0
        same_weights_reload(model)
        rederive_in_place(model)
        assert guard.check().empty, "a same-weights reload that re-processes must be clean"
        medians[lineage] = median_ms(guard.check, args.check_repeat)
        del graphs, guard, t
    ratio = medians[True] / medians[False]
    show([
        "# graphtrace guard.check(): freshness against identity only, Llama-70B-shaped model",
        f"# python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.machine()}, threads {torch.get_num_threads()}, load average at start "
        f"{load:.1f} (a shared machine: timings vary with it)",
        f"layers {args.layers}, graphs {args.graphs}, derived storages the graphs read: "
        f"{derived[True]} (lineage on), {derived[False]} (off)",
        "",
        "| guard.check(), clean | median ms |",
        "|---|---|",
        f"| identity only (lineage off, x{args.check_repeat}) | {medians[False]:.2f} |",
        f"| identity + freshness (lineage on, x{args.check_repeat}) | {medians[True]:.2f} |",
        "",
        f"ratio freshness / identity only: {ratio:.2f}  (issue 24's goal: at most 2)",
    ], args.out)
    return 0 if (args.quick or ratio <= 2.0) else 1


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter  # --clock


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--graphs", type=int, default=67)
    ap.add_argument("--check-repeat", type=int, default=50)
    ap.add_argument("--diff-repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--quick", action="store_true", help="4 layers, 3 graphs (tests)")
    ap.add_argument("--sizes", choices=("range", "vllm"), default="range",
                    help="range: batch sizes 1..--graphs; vllm: vLLM's 51 default decode sizes, "
                         "FULL and PIECEWISE (102 captures)")
    ap.add_argument("--emulate", type=int, choices=(0, 1), default=1,
                    help="gt.capture(emulate=...) (default 1: replayable emulated graphs)")
    ap.add_argument("--freshness", action="store_true",
                    help="guard.check() with freshness against identity only (issue 24)")
    ap.add_argument("--norm", choices=tuple(NORMS), default="rms",
                    help="the layers' norm module: rms (no float held), layernorm "
                         "(nn.LayerNorm) or llama-rms (transformers' LlamaRMSNorm): the last "
                         "two hold their epsilon as a float (a baked-scalar holder each)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: perf_counter (default); cpu: this thread's CPU time (not "
                         "charged while other processes hold the CPU: a loaded machine)")
    args = ap.parse_args(argv)
    global NORM, clock
    NORM = NORMS[args.norm]
    clock = CLOCKS[args.clock]
    if args.quick:
        args.layers, args.graphs, args.check_repeat, args.diff_repeat = 4, 3, 5, 1
    if args.sizes == "vllm":
        sizes = VLLM_SIZES[:3] if args.quick else VLLM_SIZES
        captures = [(f"{kind}_bs{bs}", bs) for kind in ("full", "piecewise") for bs in sizes]
    else:
        captures = [(f"decode_bs{bs}", bs) for bs in range(1, args.graphs + 1)]
    args.graphs = len(captures)
    if args.freshness:
        return freshness_ratio(args, captures)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    torch.manual_seed(0)
    model = LlamaForCausalLM(args.layers).eval()
    per_layer = sorted(n.split(".", 3)[3] for n, _ in model.named_parameters()
                       if n.startswith("model.layers.0."))
    norm_params = {"layernorm": ("weight", "bias")}.get(args.norm, ("weight",))
    expected = [p for p in LAYER_PARAMS if "layernorm" not in p] + [
        f"{n}.{p}" for n in ("input_layernorm", "post_attention_layernorm") for p in norm_params]
    assert per_layer == sorted(expected), per_layer
    n_params = sum(1 for _ in model.parameters())

    rss_before = rss()
    t0 = time.perf_counter()
    with torch.no_grad(), gt.trace(model) as t:
        graphs = []
        for label, bs in captures:
            with gt.capture(label, emulate=bool(args.emulate)) as g:
                model(torch.arange(bs) % 32)
            graphs.append(g)
    capture_s = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    n_accesses = sum(c.n_accesses for c in t.captures)

    t0 = time.perf_counter()
    guard = t.guard()
    build_ms = (time.perf_counter() - t0) * 1e3
    same_weights_reload(model)

    problems = guard.check()
    report = t.diff()
    assert problems.empty and report.stale.empty, "a same-weights copy reload must be clean"
    check_ms = median_ms(guard.check, args.check_repeat)
    diff_ms = median_ms(t.diff, args.diff_repeat)
    ratio = diff_ms / check_ms
    # the frames t.diff() rests on, built alone (as bench_scale.py's "frames s"): the accesses
    # frame from the recorder's columns, and the report's edges/storages/owners frames from
    # ready columns
    accesses_ms = median_ms(lambda: t.accesses, args.diff_repeat)
    build = frames_alone(report)
    frames_ms = accesses_ms + median_ms(build, args.diff_repeat)
    diff_frames = diff_ms / frames_ms

    # a reload that rebinds one holder: both find it, with the same verdict
    layer = model.model.layers[args.layers // 2].self_attn
    layer.kernel_scale = functools.partial(torch.mul, other=torch.ones(8))
    problems = guard.check()
    stale = t.diff().stale
    # an emulated graph keeps the old tensor alive (stale); with emulate=False nothing does and
    # the reload freed it (dangling)
    verdict = "stale" if args.emulate else "dangling"
    found = sorted(set(problems["verdict"])) == [verdict] and set(problems["owners"]) == set(
        stale["owners"].astype(str)) and len(problems) == len(stale) == args.graphs
    bad_ms = median_ms(guard.check, max(3, args.check_repeat // 5))

    lines = [
        "# graphtrace guard.check() vs t.diff(), Llama-70B-shaped model",
        f"# graphtrace at {revision()}; python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.machine()}, threads {torch.get_num_threads()}, load average at start "
        f"{load:.1f} (a shared machine: timings vary with it); timed by the {args.clock} clock",
        f"layers {args.layers}, norm {args.norm}, parameters {n_params} "
        f"({len(expected)} per layer), blind-spot records {len(guard.blind_spots)}, "
        f"graphs {args.graphs} ({'vLLM default decode sizes, FULL and PIECEWISE' if args.sizes == 'vllm' else 'batch sizes 1..N'}, "
        f"emulate={bool(args.emulate)}), accesses {n_accesses} (captured in {capture_s:.1f} s)",
        f"memory: {rss_before / 2**20:.0f} MiB resident before the trace, peak "
        f"{peak_mib:.0f} MiB with every graph",
        f"guard: {len(guard)} storages, {guard.n_owners} owner paths; "
        f"built in {build_ms:.1f} ms",
        "",
        "| what | median ms |",
        "|---|---|",
        f"| guard.check(), clean (x{args.check_repeat}) | {check_ms:.2f} |",
        f"| guard.check(), one holder rebound | {bad_ms:.2f} |",
        f"| t.diff() (x{args.diff_repeat}) | {diff_ms:.1f} |",
        f"| its frames alone (x{args.diff_repeat}; accesses {accesses_ms:.1f}) | {frames_ms:.1f} |",
        "",
        f"load average at the end {os.getloadavg()[0]:.1f}",
        "",
        f"ratio diff / check: {ratio:.0f}x",
        f"ratio diff / its frames: {diff_frames:.1f}x (goal <= 3x)",
        f"rebound holder: found by check and diff alike ({len(problems)} edges, {verdict}): "
        f"{'yes' if found else 'NO'}",
    ]
    # issue 39: with float holders (a baked-scalar record per norm module and graph), a clean
    # check <= 1 ms and one after an update <= 5 ms; without, issue 14's <= 10 ms
    clean_goal, bad_goal = (1.0, 5.0) if args.norm != "rms" else (10.0, float("inf"))
    targets = check_ms <= clean_goal and bad_ms <= bad_goal and ratio >= 50.0
    if not args.quick:
        after = f", after an update <= {bad_goal:g} ms" if bad_goal != float("inf") else ""
        lines.append(f"targets (check <= {clean_goal:g} ms{after}, >= 50x faster than diff): "
                     f"{'met' if targets else 'MISSED'}")
    show(lines, args.out)
    if not found:
        return 1
    return 0 if (args.quick or targets) else 1


if __name__ == "__main__":
    sys.exit(main())
