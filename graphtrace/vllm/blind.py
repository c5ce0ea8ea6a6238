"""What the recorder cannot see inside a vLLM model, found by looking at the model itself.

A dispatch mode sees tensors that are passed to ops. On vLLM's CPU backend some of a
model's reads are not:

* ``onednn``: plain linear weights are prepacked into oneDNN handles by
  ``dispatch_cpu_unquantized_gemm`` (``process_weights_after_loading``): the registered
  ``weight`` becomes an empty tensor and the forward calls ``_C::onednn_mm`` with a 0-d int64
  ``handler_tensor`` holding a C++ pointer, kept in the closure of ``layer.cpu_linear``
  (``CPUDNNLGEMMHandler``). The recorder sees the handle tensor, never the packed weights
  behind it.
* ``packed_copy``: the same handle for a layer whose weight stays registered and full
  (``lm_head``, ``embed_tokens``: ``remove_weight=False``): a reload refreshes the registered
  weight, while the GEMM reads the packed copy behind the handle.
* ``empty_parameter``: any other empty parameter (its data lives somewhere we did not find).
* ``compiled`` (engine setting): with ``torch.compile`` on, Inductor-generated kernels read
  tensors without going through the dispatcher. graphtrace's core records each compiled
  region's call with its inputs (graphtrace.compiled), so this is reported only when the
  engine compiles and no capture recorded a compiled region.
* ``forward_context``: attention ops (``vllm::unified_attention_with_output``,
  ``vllm::unified_kv_cache_update``) take the layer *name* and fetch the KV cache from the
  forward context inside the op: those KV-cache reads and writes are not visible.

Each finding is a dict (``kind``, ``path``, ``holder``, ``detail``); :func:`record` turns
one into the `graphtrace.BlindSpot` (kind from ``RECORD_KINDS``, text from :func:`describe`)
that goes into ``report.blind_spots``. A ``packed_copy`` is also a pairing the adapter hands
to ``Trace.watch_copy`` (Note [derived copies] in graphtrace/derived.py).
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

__all__ = ["find_blind_spots", "engine_blind_spots", "describe", "handle_holders", "record",
           "RECORD_KINDS"]

# vLLM finding kind -> graphtrace.vocab.BLIND_SPOT_KINDS
RECORD_KINDS = {"onednn": "opaque handle", "packed_copy": "packed copy",
                "empty_parameter": "empty parameter", "forward_context": "forward context",
                "compiled": "compiled"}


def _closure_items(fn) -> Iterator[tuple[str, object]]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None)
    if code is None or not cells:
        return
    for name, cell in zip(code.co_freevars, cells):
        try:
            yield name, cell.cell_contents
        except ValueError:  # empty cell
            continue


def handle_holders(module: nn.Module) -> list[tuple[str, object]]:
    """``(path suffix, handler)`` for every oneDNN handle kept by ``module.cpu_linear``."""
    fn = module.__dict__.get("cpu_linear")
    out = []
    for name, value in _closure_items(fn):
        if type(value).__name__.endswith("GEMMHandler") and hasattr(value, "handler_tensor"):
            out.append((f"cpu_linear.__closure__[{name!r}]", value))
    return out


def find_blind_spots(model: nn.Module, prefix: str = "") -> list[dict]:
    """Scan a (loaded) vLLM model for reads the recorder cannot see; see the module doc."""
    found: list[dict] = []
    attention_layers: list[str] = []
    pre = f"{prefix}:" if prefix else ""
    for fqn, module in model.named_modules():
        dot = f"{fqn}." if fqn else ""
        handles = handle_holders(module)
        for pname, param in module.named_parameters(recurse=False):
            path = f"{dot}{pname}"
            if param.is_meta:
                continue
            if param.numel() == 0:
                if handles and pname == "weight":
                    suffix, h = handles[0]
                    found.append({
                        "kind": "onednn", "path": pre + path,
                        "holder": f"{pre}{dot}{suffix}.handler_tensor",
                        "detail": f"n={getattr(h, 'n', '?')} k={getattr(h, 'k', '?')} "
                                  f"dtype={str(param.dtype).replace('torch.', '')}",
                    })
                else:
                    found.append({"kind": "empty_parameter", "path": pre + path, "holder": "",
                                  "detail": f"dtype={str(param.dtype).replace('torch.', '')}"})
            elif handles and pname == "weight":
                suffix, h = handles[0]
                found.append({
                    "kind": "packed_copy", "path": pre + path,
                    "holder": f"{pre}{dot}{suffix}.handler_tensor",
                    "detail": f"shape={tuple(param.shape)} module={type(module).__name__}",
                })
        if "kv_cache" in module.__dict__ and hasattr(module, "layer_name"):
            attention_layers.append(fqn)
    if attention_layers:
        found.append({
            "kind": "forward_context", "path": ", ".join(pre + f"{n}.kv_cache" for n in attention_layers),
            "holder": "vllm.forward_context", "detail": f"{len(attention_layers)} attention layers",
        })
    return found


def engine_blind_spots(vllm_config) -> list[dict]:
    """Blind spots that come from the engine's settings rather than the model's layers."""
    found = []
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "mode", None)
    name = getattr(mode, "name", str(mode))
    if mode is not None and name not in ("NONE", "0"):
        found.append({"kind": "compiled", "path": "model.forward", "holder": "torch.compile",
                      "detail": f"mode={name} backend={getattr(cc, 'backend', '') or ''}"})
    return found


def _split(path: str) -> tuple[str, str]:
    """("engine1", "model.x") from "engine1:model.x"; ("", path) without a model prefix."""
    model, sep, rest = path.partition(":")
    return (model, rest) if sep and "." not in model and "[" not in model else ("", path)


def record(spot: dict):
    """The `graphtrace.BlindSpot` of a finding: its holder is the path an edge's owners
    name (the handle tensor for oneDNN, the registered path otherwise), its op the op that
    reads it where one is known."""
    from graphtrace.blindspots import BlindSpot

    kind = spot["kind"]
    holder = spot.get("holder", "") if kind in ("onednn", "packed_copy") else ""
    if kind == "empty_parameter":
        holder = spot["path"]
    model, holder = _split(holder) if holder else ("", "")
    # an op only where no holder names the edges (every oneDNN GEMM is _C::onednn_mm)
    op = "vllm::unified_attention_with_output" if kind == "forward_context" else ""
    return BlindSpot(RECORD_KINDS.get(kind, "other"), describe(spot), holder=holder, op=op,
                     model=model)


def describe(spot: dict) -> str:
    """One sentence for ``report.meta['blind_spots']``."""
    kind, path, holder = spot["kind"], spot["path"], spot.get("holder", "")
    if kind == "onednn":
        return (f"vllm/onednn: {path} is empty: vLLM prepacked it into a oneDNN handle "
                f"({holder}, a 0-d int64 pointer read by _C::onednn_mm; {spot['detail']}); "
                "the recorder sees the handle tensor, not the packed weight behind it, so "
                "the impact of its edge compares pointers, not weights: a rebuilt handle "
                "reads manifest even after an identical-weights reload")
    if kind == "packed_copy":
        return (f"vllm/onednn: {path} stays registered but a GEMM through this layer reads a "
                f"packed copy behind the oneDNN handle {holder}; reads of that copy are "
                "not visible (the impact of the handle's edge compares pointers, not "
                "weights; a copy a reload does not rebuild is reported as 'packed copy not "
                "rebuilt')")
    if kind == "empty_parameter":
        return (f"vllm/empty: {path} is an empty parameter ({spot['detail']}); the forward reads "
                "its data from a holder graphtrace did not identify")
    if kind == "forward_context":
        return ("vllm/forward_context: vllm::unified_attention_with_output and "
                "vllm::unified_kv_cache_update take a layer name and fetch the KV cache from the "
                f"forward context inside the op ({spot['detail']}: {path}); those KV-cache "
                "reads and writes are not recorded")
    if kind == "compiled":
        return (f"vllm/compiled: the forward is compiled ({spot['detail']}) but no capture "
                "recorded a compiled region: Inductor-generated kernels read tensors without "
                "the dispatcher; only extern kernels and custom ops (e.g. _C::onednn_mm, "
                "vllm::unified_attention_with_output) are recorded")
    return f"vllm/{kind}: {path} {holder} {spot.get('detail', '')}".strip()

