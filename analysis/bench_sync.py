"""Check before serve: what the guard adds to one weight sync, against a check per call.

An RL client pushes a sync as one ``load_weights`` call per tensor (TRL colocate, OpenRLHF).
Under check before serve (Note [check before serve] in graphtrace/vllm/serve.py) each call
only marks the engine dirty and one `ServeGuard.check` runs before the next forward; the old
plugin checked after every call. Both are timed here on the same trace, through the real
hooks (`graphtrace.vllm.hooks.wrap_model_updates`, the ServeGuard listeners), without vLLM:

* tiny: analysis/bench_guard.py's Llama-shaped model with 2 layers;
* big: 80 layers with q/k/v biases and two kernel-like holders per layer (963 parameters +
  160 holders: 1,123 tensors), captured as vLLM's piecewise CUDA graphs would be: one graph
  per layer (and for the embedding and the head) for each of 51 decode batch sizes (4,182
  graphs).

Per sync: the time of the N ``load_weights`` calls without any hook (base), with check before
serve (N marks + one check), and with a check after every call (old); the table gives what
each adds to base. Also the per-step cost of the pre-step test when nothing is pending, and of
the part of it that looks for in-place writes (the watched parameters' version counters
compared with their sum after the last check: Note [in-place writes] in
graphtrace/serving.py).

    python analysis/bench_sync.py [--out analysis/results/bench_sync.txt]
    python analysis/bench_sync.py --quick      # small sizes (tests)

Exit status 1 when a full-size run misses the targets: <= 1 ms added per update on the tiny
model, <= 5 ms on the big one.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time

import torch
from bench_guard import MLP, LlamaForCausalLM
from torch import nn

import graphtrace as gt
from _common import revision, show
from graphtrace.vllm import hooks
from graphtrace.vllm.serve import ServeGuard, before_step

DECODE_SIZES = [1, 2, 4] + list(range(8, 8 * 49, 8))  # 51 sizes


class SyncModel(LlamaForCausalLM):
    """The bench model with vLLM's ``load_weights`` contract: (name, tensor) pairs copied
    into the registered tensors."""

    def load_weights(self, weights):
        params = self.__dict__.get("_params") or self.__dict__.setdefault(
            "_params", dict(self.named_parameters()))
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


def build(layers: int, big: bool) -> SyncModel:
    torch.manual_seed(0)
    model = SyncModel(layers).eval()
    if big:
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.bias = nn.Parameter(torch.zeros(lin.out_features))
            layer.mlp.__class__ = HolderMLP
            layer.mlp.kernel_scale = functools.partial(torch.mul, other=torch.ones(2 * 8))
    return model


class HolderMLP(MLP):
    """The MLP with a kernel-like holder (a tensor in a partial), as a quant method keeps."""

    def forward(self, x):
        h = torch.nn.functional.silu(self.gate_proj(x)) * self.kernel_scale(self.up_proj(x))
        return self.down_proj(h)


def capture_piecewise(model: SyncModel, sizes: list[int]):
    """One graph per piece (embedding, each layer, norm + head) per batch size."""
    with torch.no_grad(), gt.trace(model) as t:
        for bs in sizes:
            ids = torch.arange(bs) % 32
            with gt.capture(f"embed_bs{bs}"):
                x = model.model.embed_tokens(ids)
            for i, layer in enumerate(model.model.layers):
                with gt.capture(f"layer{i}_bs{bs}"):
                    x = layer(x)
            with gt.capture(f"head_bs{bs}"):
                model.lm_head(model.model.norm(x))
    return t


class _Engine:
    """What a ServeGuard needs of its VllmTrace."""

    def __init__(self, trace):
        self.trace = trace
        self.worker = None
        self.graphs: list = []


class _Core:
    """What the pre-step test reads of vLLM's EngineCore."""

    class _Scheduler:
        def has_unfinished_requests(self):  # what serve.before_step asks
            return True

        def has_requests(self):
            return True

    def __init__(self):
        self.scheduler = self._Scheduler()
        self.batch_queue = None


def best_ms(fn, repeat: int) -> float:
    """The shortest of `repeat` runs (the machine is shared: the minimum is the stable one)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


class _Noop:
    """A model whose load_weights does nothing: the hooks' own cost per call."""

    def load_weights(self, weights):
        return set()


def measure(name: str, layers: int, big: bool, sizes: list[int], repeat: int) -> dict:
    model = build(layers, big)
    n_params = sum(1 for _ in model.parameters())
    t0 = time.perf_counter()
    t = capture_piecewise(model, sizes)
    capture_s = time.perf_counter() - t0
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    engine = _Engine(t)
    sg = ServeGuard(engine, "raise")

    def sync():
        for pair in weights:
            model.load_weights([pair])

    base_ms = best_ms(sync, repeat)
    noop = _Noop()
    noop_base_ms = best_ms(lambda: [noop.load_weights([p]) for p in weights], repeat)
    hooks.wrap_model_updates(model)
    hooks.wrap_model_updates(noop)
    hooks.add_listener("before_update", sg.before_update)
    hooks.add_listener("after_update", sg.after_update)
    try:
        def serve_sync():  # N marks, then the one check before the next forward
            sync()
            before_step(core)

        def old_sync():  # the old plugin: a check after every call
            for pair in weights:
                model.load_weights([pair])
                sg.check("load_weights")

        core = _Core()
        serve_sync()  # builds the guard once (as the first update after the captures does)
        assert sg.last["ok"] and not sg.dirty
        n_checks = sg.checks
        serve_ms = best_ms(serve_sync, repeat)
        per_update_checks = (sg.checks - n_checks) / repeat
        old_ms = best_ms(old_sync, max(3, repeat // 3))
        idle_us = best_ms(lambda: [before_step(core) for _ in range(1000)], 5)  # x1000: µs
        inplace_us = best_ms(lambda: [sg.written_in_place() for _ in range(1000)], 5)
        watched = sg.status()["watched"]
        with torch.no_grad():  # an in-place write through no hooked entry point: checked
            model.model.norm.weight.mul_(1.0)
        n_checks = sg.checks
        before_step(core)
        inplace_checked = sg.checks - n_checks == 1 and sg.last["updates"] == ["in-place write"]

        def noop_sync():  # the hooks alone: N calls of an update (the engine dirty)
            for pair in weights:
                noop.load_weights([pair])

        sg.mark("load_weights")
        hooks_ms = best_ms(noop_sync, repeat) - noop_base_ms
        check_ms = best_ms(lambda: sg.check("before_forward", force=True), repeat)
        # a rebinding update is caught by the one check
        layer = model.model.layers[layers // 2].self_attn
        layer.kernel_scale = functools.partial(torch.mul, other=torch.ones(8))
        sync()
        try:  # what the pre-step test runs when the engine is dirty
            sg.check("before_forward")
            refused = False
        except gt.StaleGraphError as exc:
            refused = "kernel_scale" in str(exc)
    finally:
        sg.close()
        hooks.uninstall()
    return {"name": name, "layers": layers, "params": n_params, "tensors": len(sg.guard),
            "graphs": len(t.captures), "capture_s": capture_s, "calls": len(weights),
            "base_ms": base_ms, "serve_ms": serve_ms, "old_ms": old_ms,
            "added_ms": serve_ms - base_ms, "old_added_ms": old_ms - base_ms,
            "hooks_ms": hooks_ms, "check_ms": check_ms,
            "checks_per_update": per_update_checks, "idle_us": idle_us, "refused": refused,
            "inplace_us": inplace_us, "watched": watched, "inplace_checked": inplace_checked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--quick", action="store_true", help="small sizes (tests)")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.quick:
        runs = [("tiny", 2, False, DECODE_SIZES[:3], 3), ("big", 4, True, DECODE_SIZES[:3], 3)]
    else:
        runs = [("tiny", 2, False, DECODE_SIZES, args.repeat),
                ("big", 80, True, DECODE_SIZES, max(5, args.repeat // 3))]
    rows = [measure(*r) for r in runs]
    lines = [
        "# check before serve: what the guard adds to one weight sync (one load_weights per tensor)",
        f"# graphtrace {revision()}",
        f"# python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"threads {torch.get_num_threads()}, load average at start {load:.1f} (a shared machine: "
        "timings vary with it)",
        "",
        "| model | layers | parameters | guarded storages | graphs | load_weights calls | "
        "sync, no hook (ms) | sync, check before serve (ms) | sync, check per call (ms) | "
        "per update: hooks + one check (ms) | of which the check (ms) | old per-call cost (ms) | "
        "old / new | checks per update | idle pre-step test (µs) | of which in-place write test (µs, "
        "parameters watched) | in-place write checked | stale update refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        # what an update costs: the hooks of N calls and one check (measured on a no-op
        # load_weights: the difference of two whole syncs is within this machine's noise)
        r["per_update_ms"] = r["hooks_ms"] + r["check_ms"]
        ratio = r["old_added_ms"] / r["per_update_ms"] if r["per_update_ms"] > 0 else float("inf")
        lines.append(
            f"| {r['name']} | {r['layers']} | {r['params']} | {r['tensors']} | {r['graphs']} | "
            f"{r['calls']} | {r['base_ms']:.2f} | {r['serve_ms']:.2f} | {r['old_ms']:.1f} | "
            f"{r['per_update_ms']:.3f} | {r['check_ms']:.3f} | {r['old_added_ms']:.1f} | "
            f"{ratio:.0f}x | {r['checks_per_update']:.0f} | {r['idle_us']:.2f} | "
            f"{r['inplace_us']:.2f} ({r['watched']}) | {'yes' if r['inplace_checked'] else 'NO'} | "
            f"{'yes' if r['refused'] else 'NO'} |")
    tiny, big = rows
    targets = tiny["per_update_ms"] <= 1.0 and big["per_update_ms"] <= 5.0
    lines.append("")
    lines.append(f"captures: tiny {tiny['capture_s']:.1f} s, big {big['capture_s']:.1f} s")
    if not args.quick:
        lines.append(f"targets (<= 1 ms per update tiny, <= 5 ms big): "
                     f"{'met' if targets else 'MISSED'}")
    show(lines, args.out)
    ok = all(r["refused"] and r["checks_per_update"] == 1 and r["inplace_checked"] for r in rows)
    return 0 if ok and (args.quick or targets) else 1


if __name__ == "__main__":
    sys.exit(main())
