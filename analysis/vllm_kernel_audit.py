"""Audit vLLM 0.32's own linear kernels and fused-MoE quant methods on CPU: which tensors their real weight processing
and apply code leave stale after vLLM's real layerwise reload (issue #15, part 2).

Every kernel class exported by `vllm.model_executor.kernels.linear` is driven, one at a time,
through the code vLLM runs for it:

1. a `ReplicatedLinear` built with a compressed-tensors (or Quark) scheme whose kernel
   selection is narrowed to the one class audited; the scheme's `create_weights` makes the
   checkpoint parameters with their weight loaders;
2. `record_metadata_for_reloading` right after construction, then each parameter's
   `weight_loader`, then the quant method's `process_weights_after_loading`;
3. the apply path (`quant_method.apply` -> `kernel.apply_weights`) captured with
   `gt.capture` under `gt.trace(model)`;
4. new weights through vLLM's layerwise reload (`initialize_layerwise_reload`, each
   parameter's weight loader, `finalize_layerwise_reload`), then `t.diff()` and, where the
   graph has stale edges, a flip test on the emulated replay.

This is the harness: the rows, findings and stand-ins are tables (docs/audit.md), and only the
stand-ins pretend (Note [audit stand-ins]). Run:
    PYTHONPATH=$PWD .venv-vllm/bin/python analysis/vllm_kernel_audit.py [--kernel NAME] [--out DIR]

Writes analysis/results/vllm_kernel_audit.md and .csv (one row per kernel class) and .cpu.json
(the CPU they were made on). Every row runs in a process of its own (Note [audit row
isolation]); which rows depend on the CPU: Note [audit CPU paths].
"""

from __future__ import annotations

# Note [audit stand-ins]
# ~~~~~~~~~~~~~~~~~~~~~~
# Most kernels end in a CUDA-only custom op (`_C::machete_mm`, `_C::cutlass_scaled_mm`, ...)
# that the CPU build of vLLM does not register, or in a Python library that is not installed
# here (flashinfer, aiter, deep_gemm, ...). The audit asks only which storages a kernel's
# *Python* keeps and hands to those ops, so:
# - a missing `_C` op gets a CPU stand-in registered under its real name with the schema of
#   the real op (writes marked `Tensor!`, so graphtrace classifies the access the same way).
#   Its output has the real op's shape and dtype; its values are a function of every tensor
#   it reads (a sum), so the flip test can tell which storage a replay reads. Ops the CPU
#   build already has (`torch.ops._C.<name>` resolves) are never replaced;
# - capability and platform questions (`is_supported`, `can_implement`, the platform's
#   device capability, `is_cuda`) are answered yes by patches applied inside a context
#   manager around one kernel's run and restored after it;
# - nothing else is patched: the scheme's create_weights, the weight loaders, the kernel's
#   process_weights_after_loading and apply_weights, and vLLM's reload all run as shipped.
# A finding is reported against vLLM only after the source line that rebinds or holds the
# tensor has been read (FINDING_SOURCES, vllm_audit_findings.py); a stale edge whose owner is made by the
# harness would be a stand-in artifact, and is listed as such.
import argparse
import contextlib
import csv
import inspect
import io
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path

for _key, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                     "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "ERROR"}.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, revision, write_results  # noqa: E402

RESULTS = ROOT / "analysis" / "results"
K_IN, N_OUT, BATCH = 256, 128, 4   # in features, out features, tokens: tiny, block-aligned


# ---------------------------------------------------------------------------------------------
# Stand-ins (Note [audit stand-ins]): analysis/vllm_audit_standins.py

import vllm_audit_standins as standins  # noqa: E402

# The rows and findings are data, reviewed apart from this harness: analysis/vllm_audit_rows.py
# (what each row runs and what is expected of it), analysis/vllm_audit_findings.py (the vLLM
# line behind each finding); how to add a row: docs/audit.md.
from vllm_audit_findings import (  # noqa: E402
    PUBLISHED_MOE_BUGS,
    RELOAD_DROP_SOURCE,
    RELOAD_FAILURES,
    finding_source,
)
from vllm_audit_rows import (  # noqa: E402,F401 (CPU_DEPENDENT: read by the tests)
    ACT_DTYPE,
    BUILD_DEPENDENT,
    CPU_DEPENDENT,
    LINEAR_SCHEMES,
    MOE_BASE_WHY_NOT,
    MOE_BASES,
    MOE_CONFIGS,
    MOE_EXPERTS,
    MOE_FORCED_BACKENDS,
    MOE_FORCED_WHY_NOT,
    MOE_HIDDEN,
    MOE_INTER,
    MOE_LAYER_ARGS,
    MOE_NOT_DRIVEN,
    MOE_PACKAGES,
    MOE_TOPK,
    NO_FLIP,
    SELECTION_LISTS,
    linear_scheme_row,
)


def install_standins() -> list[str]:
    """Install every stand-in the audit uses; returns the op names registered."""
    return standins.install()


# ---------------------------------------------------------------------------------------------
# The registry: every kernel class vLLM exports, and the scheme that drives each family

@dataclass
class KernelInfo:
    name: str
    cls: type
    family: str          # the selection list it is chosen from (or its base class)
    source: str          # file:line of the class, relative to the vllm package
    backend: str = ""    # MoE only: the `moe_backend` the harness requests (Note [audit MoE backends])

    @property
    def method(self) -> str:
        """The class name (a forced-backend row is named `Class@backend`)."""
        return self.name.split("@")[0]


def _vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parent


def _rel(path: str) -> str:
    """vLLM's files relative to site-packages, the repository's relative to its root."""
    for root in (_vllm_root().parent, Path(__file__).resolve().parents[1]):
        try:
            return str(Path(path).resolve().relative_to(root))
        except ValueError:
            continue
    return path


def discover() -> list[KernelInfo]:
    """Every concrete kernel class exported by vllm.model_executor.kernels.linear."""
    import vllm.model_executor.kernels.linear as kl

    found: dict[str, KernelInfo] = {}
    for name, obj in vars(kl).items():
        if not (inspect.isclass(obj) and issubclass(obj, _kernel_bases(kl))):
            continue
        if inspect.isabstract(obj):
            continue
        family = _family(kl, obj)
        _, line = inspect.getsourcelines(obj)
        found[name] = KernelInfo(name, obj, family, f"{_rel(inspect.getsourcefile(obj))}:{line}")
    return sorted(found.values(), key=lambda k: (k.family, k.name))


def _kernel_bases(kl) -> tuple[type, ...]:
    return (kl.MMLinearKernel, kl.MPLinearKernel, kl.ScaledMMLinearKernel, kl.NvFp4LinearKernel,
            kl.MxFp4LinearKernel, kl.Mxfp8LinearKernel, kl.MxFp6LinearKernel)


def _family(kl, cls) -> str:
    for attr, family in SELECTION_LISTS.items():
        lists = getattr(kl, attr)
        if any(cls in v for v in lists.values()):
            return family
    for base, family in ((kl.MPLinearKernel, "wNa16"), (kl.Int8ScaledMMLinearKernel, "int8"),
                         (kl.Fp8BlockScaledMMLinearKernel, "fp8_block"),
                         (kl.FP8ScaledMMLinearKernel, "fp8"), (kl.NvFp4LinearKernel, "nvfp4"),
                         (kl.MxFp4LinearKernel, "mxfp4"), (kl.Mxfp8LinearKernel, "mxfp8"),
                         (kl.MxFp6LinearKernel, "mxfp6")):
        if issubclass(cls, base):
            return family
    return "other"


def _backend_of(cls) -> str | None:
    import vllm.model_executor.kernels.linear as kl

    for backend, kernels in kl._LINEAR_BACKEND_KERNEL_MAP.items():
        if cls in kernels:
            return backend
    return None


def make_scheme(k: KernelInfo):
    """(scheme, quant-method class, activation dtype) that selects `k` in vLLM's own code: its
    LINEAR_SCHEMES row (analysis/vllm_audit_rows.py) built from vLLM's classes."""
    import importlib

    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct

    row = linear_scheme_row(k.name, k.family)
    if row not in LINEAR_SCHEMES:
        raise NotImplementedError(f"no driver for family {k.family!r}")
    name, args, kwargs = LINEAR_SCHEMES[row]
    quant = "vllm.model_executor.layers.quantization"

    def value(a):
        if isinstance(a, dict):
            return QuantizationArgs(**a)
        if isinstance(a, str) and a.startswith("quant_utils:"):
            return getattr(importlib.import_module(f"{quant}.utils.quant_utils"), a.split(":")[1])
        return a

    if name.startswith("quark:"):
        from vllm.model_executor.layers.quantization.quark import schemes
        from vllm.model_executor.layers.quantization.quark.quark import QuarkLinearMethod as method
        name = name.split(":")[1]
    else:
        from vllm.model_executor.layers.quantization.compressed_tensors import schemes
        method = ct.CompressedTensorsLinearMethod
    scheme = getattr(schemes, name)(*map(value, args), **kwargs)
    return scheme, method, ACT_DTYPE[k.family]


# ---------------------------------------------------------------------------------------------
# Capability and platform answers, inside one kernel's run only

@contextlib.contextmanager
def forced(k: KernelInfo, act_dtype: torch.dtype):
    """Select `k` and only `k` in vLLM's kernel selection, with its capability checks passed;
    everything is restored on exit."""
    from types import SimpleNamespace

    import vllm.model_executor.kernels.linear as kl
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform

    saved: list[tuple[object, str, object]] = []

    def patch(obj, attr, value):
        saved.append((obj, attr, obj.__dict__.get(attr, _MISSING) if isinstance(obj, type)
                      else getattr(obj, attr, _MISSING)))
        setattr(obj, attr, value)

    yes = classmethod(lambda cls, *a, **kw: (True, None))
    # On a GPU the tensors are already there: `.cuda()` returns the tensor itself.
    patch(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    patch(k.cls, "is_supported", yes)
    patch(k.cls, "can_implement", yes)
    for attr in SELECTION_LISTS:
        lists = getattr(kl, attr)
        narrowed = {enum: ([k.cls] if any(k.cls in v for v in lists.values()) else [])
                    for enum in lists}
        narrowed[current_platform._enum] = [k.cls] if any(narrowed.values()) else []
        patch(kl, attr, narrowed)
    # kernels outside every selection list are reached through their family's list
    family_list = {v: a for a, v in SELECTION_LISTS.items()}[k.family]
    getattr(kl, family_list)[current_platform._enum] = [k.cls]

    config = VllmConfig()
    backend = _backend_of(k.cls)
    if backend is not None:
        config.kernel_config.linear_backend = backend
    model_config = SimpleNamespace(dtype=act_dtype, quantization=None,
                                   is_deepseek_mla=False, hf_config=None)
    try:
        object.__setattr__(config, "model_config", model_config)
        with set_current_vllm_config(config):
            yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_MISSING = object()


# ---------------------------------------------------------------------------------------------
# One kernel: build, load, process, capture, reload through vLLM, diff, flip

def init_single_process_group() -> None:
    """vLLM's parameters ask the tensor-parallel group for their rank: make a world of one."""
    import socket

    from vllm.distributed import parallel_state as ps

    if ps._TP is not None:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(1, 1)


class AuditModel(torch.nn.Module):
    """The smallest model vLLM's reload accepts: one quantized linear layer."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.proj = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def checkpoint_for(layer: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors shaped like the layer's construction-time parameters, with
    values each kind of tensor may hold (positive scales, in-range group indices)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in layer.named_parameters():
        shape, dt = tuple(p.shape), p.dtype
        if "g_idx" in name:
            k = shape[0]
            out[name] = (torch.arange(k) // 128).to(dt)
        elif dt.is_floating_point:
            v = torch.rand(shape, generator=g) + 0.5
            if "scale" not in name:
                v = torch.randn(shape, generator=g)
            if dt.itemsize == 1:   # fp8 / e8m0 scales
                if dt == getattr(torch, "float8_e8m0fnu", None):
                    v = torch.full(shape, 2.0) ** torch.randint(-3, 3, shape, generator=g)
                v = v.clamp(-200, 200)
            out[name] = v.to(dt)
        elif dt == torch.bool:
            out[name] = torch.ones(shape, dtype=dt)
        else:
            info = torch.iinfo(dt)
            lo, hi = max(info.min, -(2 ** 31)), min(info.max, 2 ** 31 - 1)
            out[name] = torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dt)
    return out


def load(layer: torch.nn.Module, ckpt: dict[str, torch.Tensor]) -> None:
    """vLLM's own loading: each parameter's weight_loader."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for name, value in ckpt.items():
        param = getattr(layer, name)
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, value)


@dataclass
class Outcome:
    kernel: KernelInfo
    ran: bool = False
    stage: str = ""                  # the step that failed, when not ran
    reason: str = ""
    scheme: str = ""
    edges: dict = field(default_factory=dict)        # verdict -> count
    findings: list = field(default_factory=list)     # (verdict, owner path, nbytes, impact)
    flip: str = ""
    standins: list = field(default_factory=list)
    dropped: list = field(default_factory=list)      # loads vLLM's reload dropped (Note [audit reload drops])
    seconds: float = 0.0
    amx_asked: str = ""              # vLLM's last answer to its AMX question ("": never asked)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "stage" and value and _ROW_STAGE_HOOK is not None:
            _ROW_STAGE_HOOK(self.kernel.name, value)


# set inside a row's child process: told each stage as it starts (Note [audit row isolation])
_ROW_STAGE_HOOK = None


def audit_kernel(k: KernelInfo) -> Outcome:
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.utils.torch_utils import set_default_torch_dtype

    with row_outcome(k) as res:
        with forced(k, ACT_DTYPE[k.family]):
            # vLLM builds schemes while the model's dtype is the default (some read it)
            with set_default_torch_dtype(ACT_DTYPE[k.family]):
                scheme, method_cls, act_dtype = make_scheme(k)
            res.scheme = type(scheme).__name__
            quant_config = _OneScheme(scheme, method_cls)
            res.stage = "create_weights"
            with set_default_torch_dtype(act_dtype):
                layer = ColumnParallelLinear(K_IN, N_OUT, bias=False, params_dtype=act_dtype,
                                             quant_config=quant_config, return_bias=False,
                                             prefix="proj")
            model = AuditModel(layer)
            with torch.device("cpu"):
                record_metadata_for_reloading(model)
            res.stage = "load"
            load(layer, checkpoint_for(layer, seed=1))
            res.stage = "process_weights_after_loading"
            layer.quant_method.process_weights_after_loading(layer)
            _check_kernel(layer, k)
            res.stage = "apply"
            x = torch.randn(BATCH, K_IN, generator=torch.Generator().manual_seed(0)).to(act_dtype)
            capture_reload_diff(res, model, x, lambda: load(layer, _reload_checkpoint(model)))
    return res


@contextlib.contextmanager
def row_outcome(k: KernelInfo, on_failure=None):
    """One row's Outcome: the stand-ins it uses, the seconds it takes, and any failure as its
    reason (every failure is a row: the step, `res.stage`, and the exact reason), which
    `on_failure(res)` may extend."""
    res = Outcome(k)
    t0 = time.perf_counter()
    standins.reset_used()
    res.stage = "select"
    try:
        yield res
    except Exception as exc:
        res.reason = _reason(exc)
        if on_failure is not None:
            on_failure(res)
    res.standins = standins.used()
    res.seconds = time.perf_counter() - t0


def capture_reload_diff(res: Outcome, model, x, load_new) -> None:
    """The audit's common tail, on the scenario harness (graphtrace/demo/scenario.py): capture
    the apply; with the trace closed, reload through vLLM's layerwise reload (`load_new` runs the
    weight loaders); diff; flip test. `res.stage` names the step running, for a failure's row."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from graphtrace.demo.scenario import Scenario

    @torch.no_grad()
    def reload(m) -> None:
        initialize_layerwise_reload(m)
        load_new()
        finalize_layerwise_reload(m, model_config=None)
    inputs = x if isinstance(x, tuple) else (x,)
    with torch.no_grad():
        model(*inputs)                                  # warm-up, as before a capture
    with Scenario(model, strict=False) as sc:
        sc.capture([("apply", inputs)])
    res.stage = "reload"
    reload_with_lineage(res, sc, model, reload)         # its trace closed; lineage's open
    res.stage = "diff"
    report = sc.diff()
    res.edges = report.edges["verdict"].value_counts().to_dict()
    stale = report.stale
    res.findings += [(r.verdict, r.owners, int(r.nbytes), r.impact) for r in stale.itertuples()]
    res.stage = "flip"
    if res.dropped:
        res.flip = ("not run: vLLM's reload dropped loads (Note [audit reload drops]), so the "
                    "layer holds uninitialized values that the stand-ins read")
    else:
        res.flip = flip_test(res.kernel.name, sc, stale)
    res.ran = True
    res.stage = ""


# ---------------------------------------------------------------------------------------------
# Fused-MoE quant methods: one FusedMoE layer (vLLM's FusedMoEFactory) built with the
# method's quant config, loaded per expert and shard through the experts' weight loader,
# processed, its forward captured inside vLLM's forward context, reloaded through the
# layerwise reload (Note [audit MoE driver])

# Note [audit MoE driver]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Discovery imports every module under vllm.model_executor.layers.quantization and
# .fused_moe (pkgutil.walk_packages) and walks FusedMoEMethodBase.__subclasses__(): the
# compressed-tensors and online methods live in modules nothing imports until a checkpoint
# asks for them (compressed_tensors_moe_w8a8_fp8.py, online/fp8.py, ...), and a fixed module
# list missed them. A module that cannot be imported here has its MoE classes listed from
# its source (ast), with the import error as the reason.
# The driver builds each method the way a checkpoint would: through the real quant config
# (`Fp8Config.from_config`, `CompressedTensorsConfig.from_config`, `QuarkConfig.from_config`,
# ...) whose `get_quant_method` vLLM's FusedMoE calls, or, where vLLM builds the method from
# a CLI option rather than a checkpoint dict (online quantization), the method class with
# the arguments vLLM passes (`cls(moe=layer.moe_config)`, online/base.py). Every checkpoint
# tensor goes in per expert and shard through `weight_loader(param, value, name, shard_id,
# expert_id)`, its shape the destination slice the loader narrows to. The backend is the one
# vLLM's oracle picks for this CPU platform (CPU experts where vLLM has them); no backend is
# forced.

MOE_IMPORT_FAILURES: dict[str, str] = {}     # class name -> why its module did not import


# Note [audit MoE LoRA]
# ~~~~~~~~~~~~~~~~~~~~~
# FusedMoEModularMethod is no checkpoint format: vLLM swaps a layer's method for it when it
# wraps the layer for LoRA (FusedMoEWithLoRA.__init__, lora/layers/fused_moe.py:64-87; the
# other maker, elastic EP reconfiguration, fused_moe/eep_reconfigure.py:118, needs expert
# parallelism). Its row is driven as vLLM's LoRA model manager drives it: the VllmConfig has
# a LoRAConfig (so the unquantized oracle takes its LoRA branch, oracle/unquantized.py:234-247,
# with no device check), the layer is built, loaded and processed, then wrapped by
# `lora.utils.from_layer` with the packed list the manager passes for a MoE runner (["w1",
# "w3"], model_manager.py:535-551), which builds FusedMoEWithLoRA and its LoRA weights, and
# mapped to the platform's punica wrapper (`get_punica_wrapper`, model_manager.py:224-229;
# set_mapping). The wrapper replaces the layer in the model (replace_submodule) before the
# apply. No adapter is loaded: vLLM's forward reaches the LoRA path whenever a mapping is set.
MOE_LORA = ("FusedMoEModularMethod",)


def _wrap_for_lora(model, layer, config):
    """The layer wrapped as vLLM's LoRA model manager wraps a MoE runner (Note [audit MoE
    LoRA]); returns the wrapper, which replaces the layer in `model`."""
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper
    from vllm.lora.utils import from_layer

    lora_config = config.lora_config
    wrapped = from_layer(layer, lora_config.max_loras, lora_config, ["w1", "w3"], None)
    wrapped.set_mapping(get_punica_wrapper(BATCH, max_batches=1, device="cpu",
                                           lora_config=lora_config))
    model.moe = wrapped
    return wrapped


def _moe_source_classes(modname: str) -> list[tuple[str, int]]:
    """(class name, line) of the MoE method classes a module defines, read from its source
    (for modules that do not import on this machine)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(modname)
    tree = ast.parse(Path(spec.origin).read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", getattr(b, "attr", "")) in MOE_BASES for b in node.bases):
            out.append((node.name, node.lineno, spec.origin))
    return out


def discover_moe() -> list[KernelInfo]:
    """Every concrete FusedMoEMethodBase subclass vLLM defines (Note [audit MoE driver])."""
    import importlib
    import pkgutil

    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    _one_cpu_extension()
    failed: dict[str, str] = {}
    for pkgname in MOE_PACKAGES:
        pkg = importlib.import_module(pkgname)
        for info in pkgutil.walk_packages(pkg.__path__, pkgname + "."):
            try:
                importlib.import_module(info.name)
            except Exception as exc:  # noqa: BLE001 (listed below with the reason)
                failed[info.name] = f"{type(exc).__name__}: {exc}"
    found, seen, todo = {}, set(), [FusedMoEMethodBase]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub in seen:
                continue
            seen.add(sub)
            todo.append(sub)
            if not inspect.isabstract(sub) and sub.__module__.startswith("vllm."):
                _, line = inspect.getsourcelines(sub)
                found[sub.__name__] = KernelInfo(
                    sub.__name__, sub, "moe", f"{_rel(inspect.getsourcefile(sub))}:{line}")
    for modname, why in failed.items():
        for name, line, path in _moe_source_classes(modname):
            if name not in found:
                MOE_IMPORT_FAILURES[name] = f"its module does not import here: {why}"
                found[name] = KernelInfo(name, None, "moe", f"{_rel(path)}:{line}")
    out = sorted(found.values(), key=lambda k: k.name)
    for method, backend in MOE_FORCED_BACKENDS:
        base = found[method]
        out.append(KernelInfo(f"{method}@{backend}", base.cls, "moe", base.source, backend))
    return out


# Note [audit CPU extension]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# vLLM's CPU wheel ships three builds of its `_C` extension and loads one by the CPU's ISA
# (CpuPlatform.import_kernels, vllm/platforms/cpu.py:631-666): `vllm._C` only with AVX-512 and
# AVX512-BF16, else `vllm._C_AVX512` or `vllm._C_AVX2`, whose import registers the ops and then
# raises ("dynamic module does not define module export function"), so `vllm._C` stays out of
# sys.modules. vllm/platforms/rocm.py:56 does `import vllm._C` at module level, and discovery
# reaches it (fused_moe/router/rocm_fp32_router_gemm.py:8 imports it): on a CPU without
# AVX512-BF16 that loads a second build that registers TORCH_LIBRARY(_C) again, and the process
# aborts (c10::Error from Dispatcher.cpp, "Only a single TORCH_LIBRARY can be used to register
# the namespace _C"). When the platform loaded another build, `vllm._C` is entered in
# sys.modules as an empty module before discovery: its ops are already registered, and every
# `import vllm._C` in vLLM is for that side effect only.


def _one_cpu_extension() -> None:
    """Note [audit CPU extension]."""
    import types

    from vllm.platforms import CpuArchEnum, current_platform

    if "vllm._C" in sys.modules or not current_platform.is_cpu():
        return
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return
    if torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported():
        return
    sys.modules["vllm._C"] = types.ModuleType(
        "vllm._C", "placeholder: the ops of vllm._C_AVX2/_C_AVX512 are registered as torch.ops._C "
                   "(analysis/vllm_kernel_audit.py, Note [audit CPU extension])")


@contextlib.contextmanager
def forced_moe_device(backend: str = ""):
    """Every loaded FusedMoEExperts class supports the current device, and the platform
    reports a Hopper (SM 9.0) with FP8, for the experts' scheme checks; for the AITER backend,
    `rocm_aiter_ops.get_moe_dispatch_policy` (which AiterExperts passes to the MoE op) runs
    its own body without its `@if_aiter_supported` gate (_aiter_ops.py:278, :2003), which
    answers None off ROCm. Restored on exit."""
    import vllm._aiter_ops as aiter_ops
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    platform = current_platform if isinstance(current_platform, type) else type(current_platform)
    old_platform = {a: platform.__dict__.get(a, _MISSING)
                    for a in ("get_device_capability", "supports_fp8")}
    platform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    platform.supports_fp8 = classmethod(lambda cls: True)
    saved, todo = [], [mk.FusedMoEExperts]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "_supports_current_device" in cls.__dict__:
            saved.append((cls, "_supports_current_device", cls.__dict__["_supports_current_device"]))
            cls._supports_current_device = staticmethod(lambda: True)
        if "_supports_quant_scheme" in cls.__dict__:
            old_check = cls.__dict__["_supports_quant_scheme"]
            saved.append((cls, "_supports_quant_scheme", old_check))
            kind = type(old_check) if isinstance(old_check, (staticmethod, classmethod)) \
                else None
            fn = _as_cuda(platform, old_check.__func__ if kind else old_check)
            cls._supports_quant_scheme = kind(fn) if kind else fn
    # `torch.accelerator.empty_cache()` (quark_moe.py:1844, after the weights are replaced)
    # frees a device's cached blocks; with no accelerator it raises, so it does nothing here
    empty_cache = torch.accelerator.empty_cache
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.empty_cache = lambda: None
    aiter_cls = aiter_ops.rocm_aiter_ops
    policy = aiter_cls.__dict__["get_moe_dispatch_policy"]
    if backend == "aiter":
        aiter_cls.get_moe_dispatch_policy = classmethod(policy.__func__.__wrapped__)
    try:
        yield
    finally:
        aiter_cls.get_moe_dispatch_policy = policy
        torch.accelerator.empty_cache = empty_cache
        for cls, attr, old in reversed(saved):
            setattr(cls, attr, old)
        for attr, old in old_platform.items():
            if old is _MISSING:
                delattr(platform, attr)
            else:
                setattr(platform, attr, old)


# Note [audit CPU experts]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# vLLM's quantized CPU MoE experts (CPUExpertsInt4, CPUExpertsInt8, CPUExpertsMxfp4,
# CPUExpertsFp8; fused_moe/experts/cpu_moe.py) answer `_supports_current_device()` with
# `is_cpu() and x86 and torch.cpu._is_amx_tile_supported()` (cpu_moe.py:456-460, :624-628,
# :840-844, :999-1003), so on this CPU no oracle offers them (Note [audit AMX probe]). Their
# kernels are the sgl-kernels MoE of vLLM's AVX-512 build (`fused_experts_cpu`, with
# `convert_weight_packed`, `convert_scale_packed` and `convert_weight_packed_scale_zp` for the
# weights), which choose their inner GEMM per block of rows themselves: `at::native::cpublas::
# brgemm` (oneDNN, AMX) when `can_use_brgemm<T>(M)` holds, the AVX-512 `tinygemm_kernel`s
# (vec.h, avx512-bf16 / avx512-vnni intrinsics) otherwise (csrc/cpu/sgl-kernels/moe*.cpp and
# gemm.h in the vllm-project/vllm repository; the wheel ships no C++). A row `Class@cpu` runs
# the method with the shipped device check of those four classes widened to "x86 CPU": the
# check runs as shipped (so the row asks vLLM's AMX question and records the answer,
# Outcome.amx_asked) and where it says no, the row answers yes when the platform is an x86 CPU.
# Nothing else changes: no backend is requested (the oracle's own priority list picks the CPU
# experts), no platform question is faked, and the real native ops run (no stand-in). Which
# native path ran: the audit's MoE layer routes 4 tokens to top-2 of 4 experts, so no expert
# gets more than 4 rows and `can_use_brgemm` (M > 4 for bfloat16, int8 and FP8) is false: the
# AVX-512 tinygemm kernels. Checked on the AVX-512 CPU the committed results were made on: with
# ONEDNN_VERBOSE=all the rows CompressedTensorsW8A8Int8MoEMethod@cpu, AutoGPTQMoEMethod@cpu,
# Mxfp4MoEMethod@cpu and Fp8PerBlockOnlineMoEMethod@cpu printed no oneDNN line (the same torch
# prints them for a bfloat16 matmul), and no row raised SIGILL. The output values are not
# compared with a reference here; the flip tests show which storage each side reads. Not
# widened: X86CPUUnquantizedExperts (its `isa="amx"` kernel is AMX code, cpu_moe.py:318-330)
# and CPUExpertsFp8W8A8 (`cpu_has_amx_fp8()`, :1679-1681). On a CPU with AMX the rows take
# the same classes without the widening (the answer to the AMX question is recorded) and the
# kernels may take their AMX path (CPU_DEPENDENT); the AVX2 build has none of these ops.
# Four methods the oracle gives the CPU experts on an AMX CPU do not run with them at all
# (MOE_FORCED_WHY_NOT): their failures are in vLLM's Python, the same with AMX.
CPU_EXPERTS_WIDENED = ("CPUExpertsInt4", "CPUExpertsInt8", "CPUExpertsMxfp4", "CPUExpertsFp8")


@contextlib.contextmanager
def cpu_experts_without_amx():
    """Note [audit CPU experts]: the quantized CPU experts' device check, widened to any x86
    CPU; restored on exit."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms import CpuArchEnum, current_platform

    saved = []
    for name in CPU_EXPERTS_WIDENED:
        cls = getattr(cpu_moe, name)
        shipped = cls.__dict__["_supports_current_device"]

        def widened(shipped=shipped.__func__) -> bool:
            return shipped() or (current_platform.is_cpu() and
                                 current_platform.get_cpu_architecture() == CpuArchEnum.X86)
        saved.append((cls, "_supports_current_device", shipped))
        cls._supports_current_device = staticmethod(widened)
    try:
        yield
    finally:
        for cls, attr, shipped in saved:
            setattr(cls, attr, shipped)


def _as_cuda(platform, check):
    """`check` (an experts class's `_supports_quant_scheme`) run as shipped, with the
    platform's `is_cuda()` answering yes during the call: TritonExperts asks whether the
    device has INT8 (`is_cuda() and has_device_capability((7, 5))`, experts/triton_moe.py:
    137-144) inside its scheme check, a device question the forced device answers yes."""
    def wrapped(*args, **kwargs):
        old = platform.__dict__.get("is_cuda", _MISSING)
        platform.is_cuda = classmethod(lambda cls: True)
        try:
            return check(*args, **kwargs)
        finally:
            if old is _MISSING:
                delattr(platform, "is_cuda")
            else:
                platform.is_cuda = old
    return wrapped


class MoEAuditModel(torch.nn.Module):
    """One FusedMoE layer, run inside vLLM's forward context as a model's forward would."""

    def __init__(self, layer: torch.nn.Module, config):
        super().__init__()
        self.moe = layer
        self._config = config

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, self._config):
            return self.moe(hidden_states=x, router_logits=router_logits)


class _OnlineMoE:
    """The quant config for an online MoE method: builds `cls(moe=layer.moe_config)` for the
    experts, as OnlineQuantizationConfig.get_quant_method does (online/base.py)."""

    online_quantization_config = None
    packed_modules_mapping: dict = {}

    def __init__(self, cls):
        self.cls = cls

    @staticmethod
    def get_name() -> str:
        return "online"

    def get_quant_method(self, layer, prefix):
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        return self.cls(moe=layer.moe_config) if isinstance(layer, RoutedExperts) else None

    def __getattr__(self, name):       # QuantizationConfig hooks the layer may ask for
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

        attr = getattr(QuantizationConfig, name)
        return attr.__get__(self) if callable(attr) else attr


def moe_quant_config(k: KernelInfo):
    """The quant config a checkpoint of method `k` gives vLLM (None: unquantized)."""
    if k.method in ("UnquantizedFusedMoEMethod", *MOE_LORA):
        return None
    if k.method not in MOE_CONFIGS:
        raise NotImplementedError(MOE_NOT_DRIVEN.get(k.method, "no MoE driver for this method"))
    qname, cfg = MOE_CONFIGS.get(k.name, MOE_CONFIGS[k.method])
    if qname == "online":
        return _OnlineMoE(k.cls)
    from vllm.model_executor.layers.quantization import get_quantization_config

    return get_quantization_config(qname).from_config(cfg)


def _experts(layer):
    return getattr(layer, "routed_experts", layer)


def _moe_shard_shape(experts, name: str, param, shard: str) -> tuple[int, ...]:
    """The shape of one expert's `shard` of checkpoint tensor `name`: the destination slice
    vLLM's FusedMoE weight_loader narrows to (routed_experts.py weight_loader)."""
    per_tensor = (getattr(param, "quant_method", None) == "tensor" or "input_scale" in name
                  or param.dim() == 1 or "weight_shape" in name
                  or (param.dim() == 2 and param.shape[1] <= 2 and "bias" not in name))
    if per_tensor:
        if param.dim() == 1 and getattr(param, "quant_method", None) == "channel":
            return ()      # the per-channel loader writes param[expert] (a 0-d slice)
        return (1,) if "weight_shape" not in name else tuple(param.shape[1:])
    dest = list(param.shape[1:])
    if "bias" in name:
        if shard != "w2":
            dest[0] //= 2
        return tuple(dest)
    shard_dim = {"w1": 0, "w2": 1, "w3": 0}[shard]
    if getattr(param, "is_transposed", False):
        shard_dim = int(not shard_dim)
    if shard != "w2":
        dest[shard_dim] //= 2
    if (type(getattr(experts, "quant_method", None)).__name__ in (
            "CompressedTensorsWNA16MoEMethod", "CompressedTensorsW4A16FlydslMoEMethod")
            and getattr(param, "is_transposed", False)):
        dest = dest[::-1]     # the loader transposes these first
    if (type(getattr(experts, "quant_method", None)).__name__ == "QuarkW4A16Int4MoEMethod"
            and name.endswith(("weight_scale", "weight_zero_point"))):
        dest = dest[::-1]     # quark_int4_weight_loader transposes them (quark_moe.py:524-561)
    return tuple(dest)


def _moe_checkpoint_layout(experts, name: str, dest: tuple, dtype: torch.dtype):
    """(shape, dtype) of the checkpoint tensor whose conversion by the method's own loader
    fills the destination slice `dest`: MoeWNA16Method reads GPTQ tensors, int32-packed along
    K and transposed (`loaded_weight.T.contiguous().view(torch.uint8)` for the weights,
    `loaded_weight.T` for the scales, moe_wna16.py:611-620)."""
    method = type(getattr(experts, "quant_method", None)).__name__
    if method == "MoeWNA16Method" and name.endswith("qweight"):
        return (dest[1] * 2 // 8, dest[0]), torch.int32     # (N, K/2) uint8 <- (K/8, N) int32
    if method == "MoeWNA16Method" and name.endswith("scales"):
        return tuple(dest[::-1]), dtype
    return dest, dtype


def _moe_value(name: str, shape, dt: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dt.is_floating_point:
        v = (torch.rand(shape, generator=g) + 0.5 if "scale" in name
             else torch.randn(shape, generator=g))
        if dt.itemsize == 1:
            if dt == getattr(torch, "float8_e8m0fnu", None):
                v = torch.full(shape, 2.0) ** torch.randint(-3, 3, shape, generator=g)
            v = v.clamp(-200, 200)
        return v.to(dt)
    if "scale" in name and dt == torch.uint8:       # e8m0 exponents near 2**0
        return torch.randint(124, 130, shape, generator=g, dtype=torch.uint8)
    if dt == torch.bool:
        return torch.ones(shape, dtype=dt)
    info = torch.iinfo(dt)
    lo, hi = max(info.min, -(2 ** 31)), min(info.max, 2 ** 31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dt)


def load_moe(layer, seed: int, dropped: list | None = None) -> None:
    """vLLM's per-expert loading: every experts parameter with a weight_loader, per expert
    and shard (w1, w3 into w13_*; w2 into w2_*). During a reload, `dropped` collects the
    loads vLLM's layerwise reload discards (Note [audit reload drops])."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    g = torch.Generator().manual_seed(seed)
    experts = _experts(layer)
    info = get_layerwise_info(experts) if dropped is not None else None
    combined = experts.quant_config is not None and \
        experts.quant_config.get_name() == "gpt_oss_mxfp4"
    for name, param in list(experts.named_parameters(recurse=False)):
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            continue
        if combined:                   # gpt-oss checkpoints hold all experts in one tensor
            loader(param, _moe_value(name, tuple(param.shape), param.dtype, g), name,
                   shard_id="w13" if "w13" in name else "w2", expert_id=0)
            continue
        shards = ("w2",) if name.startswith("w2") else ("w1", "w3")
        for e in range(MOE_EXPERTS):
            for shard in shards:
                shape, dtype = _moe_checkpoint_layout(
                    experts, name, _moe_shard_shape(experts, name, param, shard), param.dtype)
                value = _moe_value(name, shape, dtype, g)
                if "input_scale" in name:
                    value = torch.ones(shape, dtype=param.dtype)   # equal for w1 and w3
                # a load into an empty placeholder loses nothing: MoeWNA16Method registers
                # `w13_qzeros`/`w2_qzeros` with no elements for GPTQ checkpoints without zero
                # points (moe_wna16.py:378-389) and its loader discards their loads
                # (:593-594), so they add nothing to `load_numel_total` and arrive after
                # the layer was processed; not a dropped load
                if info is not None and not info.can_load() and param.numel():
                    dropped.append(f"{name}[{e}].{shard}")
                loader(param, value, name, shard_id=shard, expert_id=e)


def audit_moe(k: KernelInfo) -> Outcome:
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.utils.torch_utils import set_default_torch_dtype

    with row_outcome(k, _moe_why_not) as res:
        if k.name in MOE_IMPORT_FAILURES:
            raise ImportError(MOE_IMPORT_FAILURES[k.name])
        dt = torch.bfloat16
        config = VllmConfig()
        object.__setattr__(config, "model_config", SimpleNamespace(
            dtype=dt, quantization=None, is_deepseek_mla=False, hf_config=None,
            max_model_len=128, quantization_config=None))   # read by oracle/mxfp4.py:475
        if k.backend and k.backend != "cpu":
            config.kernel_config.moe_backend = k.backend
        if k.method in MOE_LORA:           # Note [audit MoE LoRA]
            from vllm.config import LoRAConfig

            object.__setattr__(config, "lora_config", LoRAConfig(
                max_loras=1, max_lora_rank=8, lora_dtype=dt))
        device = (cpu_experts_without_amx() if k.backend == "cpu" else
                  forced_moe_device(k.backend) if k.backend else contextlib.nullcontext())
        with set_current_vllm_config(config), set_default_torch_dtype(dt), device:
            quant_config = moe_quant_config(k)
            object.__setattr__(config, "quant_config", quant_config)
            res.stage = "create_weights"
            layer = FusedMoEFactory(num_experts=MOE_EXPERTS, top_k=MOE_TOPK,
                                    hidden_size=MOE_HIDDEN, intermediate_size=MOE_INTER,
                                    params_dtype=dt, quant_config=quant_config, prefix="moe",
                                    **MOE_LAYER_ARGS.get(k.name, {}))
            model = MoEAuditModel(layer, config)
            methods = {type(m.quant_method).__name__ for m in layer.modules()
                       if getattr(m, "quant_method", None) is not None}
            if k.method not in methods and k.method not in MOE_LORA:
                raise RuntimeError(f"layer selected {sorted(methods)}, not {k.method}")
            res.scheme = (type(quant_config).__name__ if quant_config is not None
                          else "unquantized")
            record_metadata_for_reloading(model)
            res.stage = "load"
            load_moe(layer, seed=1)
            res.stage = "process_weights_after_loading"
            for m in layer.modules():
                if getattr(m, "quant_method", None) is not None:
                    m.quant_method.process_weights_after_loading(m)
            res.scheme += f" -> {_moe_backend(layer)}"
            if k.method in MOE_LORA:
                res.stage = "lora"
                _wrap_for_lora(model, layer, config)
                methods = {type(m.quant_method).__name__ for m in model.modules()
                           if getattr(m, "quant_method", None) is not None}
                if k.method not in methods:
                    raise RuntimeError(f"LoRA wrapping left {sorted(methods)}, not {k.method}")
                res.scheme += " + LoRA"
            res.stage = "apply"
            g = torch.Generator().manual_seed(0)
            x = torch.randn(BATCH, MOE_HIDDEN, generator=g).to(dt)
            logits = torch.randn(BATCH, MOE_EXPERTS, generator=g).to(dt)
            capture_reload_diff(res, model, (x, logits),
                                lambda: load_moe(layer, seed=2, dropped=res.dropped))
    return res


def _moe_why_not(res: Outcome) -> None:
    """A MoE row that did not run: what AMX would change, and why, where the source was read."""
    k = res.kernel
    if not k.backend and res.stage in ("create_weights", "load",
                                       "process_weights_after_loading"):
        res.reason += f"; {amx_probe(k)}"
    why = MOE_FORCED_WHY_NOT.get(k.name) or MOE_BASE_WHY_NOT.get(k.name)
    if why:
        res.reason += f"; {why}"


def _moe_layer(k: KernelInfo, config, dt: torch.dtype):
    """The FusedMoE layer of row `k`, built as audit_moe builds it."""
    quant_config = moe_quant_config(k)
    object.__setattr__(config, "quant_config", quant_config)
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    return FusedMoEFactory(num_experts=MOE_EXPERTS, top_k=MOE_TOPK, hidden_size=MOE_HIDDEN,
                           intermediate_size=MOE_INTER, params_dtype=dt,
                           quant_config=quant_config, prefix="moe",
                           **MOE_LAYER_ARGS.get(k.name, {}))


# Note [audit AMX probe]
# ~~~~~~~~~~~~~~~~~~~~~~
# A row without a forced backend runs the backend vLLM's oracle picks for this CPU; vLLM's
# CPU MoE experts are offered only on x86 with AMX (`torch.cpu._is_amx_tile_supported()`,
# fused_moe/experts/cpu_moe.py:327-330, :457-460, :625-628, :841-844, :1000-1003) and each
# takes one quant scheme (`_supports_quant_scheme` beside each). When such a row stops at
# construction or at process_weights_after_loading, the row builds the layer once more with
# `torch.cpu._is_amx_tile_supported` answering yes during the construction only (no weight
# is loaded or processed and no kernel runs, so no AMX instruction is executed), and once
# with this CPU's answer, and appends what the construction picked with AMX: another experts
# class (an AMX CPU would take it: the row then depends on the CPU, CPU_DEPENDENT), or the
# same class, failure or no backend (AMX changes nothing; the forced `@backend` rows and
# MOE_BASE_WHY_NOT say what would). Some methods pick their experts without the oracle
# (compressed-tensors W4A4 MXFP4: CUTLASS, XPU, else Marlin,
# compressed_tensors_moe_w4a4_mxfp4.py:63-79), hence the comparison. The probe's answers are
# not recorded as the row's AMX answers (`amx_asked`).


def amx_probe(k: KernelInfo) -> str:
    """What vLLM's oracle picks for row `k` when told the CPU has AMX, against what it picks
    with this CPU's answer (Note [audit AMX probe])."""
    if k.cls is None:
        return "AMX probe: not run (the class did not import)"
    with_amx, without = _picked_experts(k, True), _picked_experts(k, None)
    if with_amx == without:
        same = "error" if with_amx.startswith("error: ") else with_amx
        return f"AMX probe: on a CPU with AMX the same {same}, so AMX changes nothing"
    if with_amx.startswith("error: "):
        return f"AMX probe: on a CPU with AMX too: {with_amx[len('error: '):]}"
    if with_amx in ("NONE", "?"):
        return f"AMX probe: on a CPU with AMX vLLM's oracle picks no backend either ({with_amx})"
    return f"AMX probe: on a CPU with AMX vLLM's oracle picks {with_amx}"


def _picked_experts(k: KernelInfo, amx: bool | None) -> str:
    """The experts class (or backend name) the layer of row `k` gets at construction, with
    `torch.cpu._is_amx_tile_supported()` answering `amx` (None: this CPU's answer, unrecorded),
    or `error: <reason>`."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    watched = torch.cpu._is_amx_tile_supported
    real = bool(watched())     # called from here, the watcher (_watch_amx) records nothing
    torch.cpu._is_amx_tile_supported = lambda: real if amx is None else amx
    try:
        dt = torch.bfloat16
        config = VllmConfig()
        object.__setattr__(config, "model_config", SimpleNamespace(
            dtype=dt, quantization=None, is_deepseek_mla=False, hf_config=None,
            max_model_len=128, quantization_config=None))
        with set_current_vllm_config(config), set_default_torch_dtype(dt):
            layer = _moe_layer(k, config, dt)
        picked = getattr(_experts(layer).quant_method, "experts_cls", None)
        return getattr(picked, "__name__", None) or _moe_backend(layer)
    except Exception as exc:  # noqa: BLE001 (the probe's answer is part of the reason)
        return f"error: {_reason(exc)}"
    finally:
        torch.cpu._is_amx_tile_supported = watched


def _moe_backend(layer) -> str:
    """The experts implementation vLLM's oracle chose (its class name), for the row."""
    for m in layer.modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        for attr in ("moe_kernel", "kernel", "fused_experts", "experts_cls"):
            v = getattr(qm, attr, None)
            if v is not None:
                inner = getattr(v, "fused_experts", v)
                return getattr(inner, "__name__", type(inner).__name__)
        for attr in ("fp8_backend", "moe_backend", "backend", "mxfp4_backend",
                     "nvfp4_backend", "int8_backend"):
            v = getattr(qm, attr, None)
            if v is not None:
                return str(getattr(v, "name", v))
    return "?"


def _reload_checkpoint(model: AuditModel) -> dict[str, torch.Tensor]:
    """New weights with the construction-time shapes (the layer holds meta tensors now)."""
    return checkpoint_for(model.proj, seed=2)


def _check_kernel(layer, k: KernelInfo) -> None:
    """The kernel the scheme selected must be the one audited."""
    found = [v for v in _walk_kernels(layer.scheme)]
    if found and not any(type(v) is k.cls for v in found):
        raise RuntimeError(f"scheme selected {[type(v).__name__ for v in found]}, not {k.name}")


def _walk_kernels(scheme):
    import vllm.model_executor.kernels.linear as kl

    for v in vars(scheme).values():
        if isinstance(v, _kernel_bases(kl)):
            yield v


class _OneScheme:
    """The quant config handed to ReplicatedLinear: gives the layer one scheme, through the
    scheme's own quant method (as CompressedTensorsConfig / QuarkConfig do per layer)."""

    online_quantization_config = None
    packed_modules_mapping: dict = {}

    def __init__(self, scheme, method_cls):
        self.scheme, self.method_cls = scheme, method_cls

    def get_quant_method(self, layer, prefix):
        # hand the scheme over and keep no reference: a real config holds none per layer
        layer.scheme, self.scheme = self.scheme, None
        return self.method_cls(self)


def _reason(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(tb) if "site-packages/vllm" in f.filename), tb[-1] if tb else None)
    loc = f" at {_rel(where.filename)}:{where.lineno}" if where else ""
    msg = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {msg}{loc}"


def _perturb(t: torch.Tensor) -> None:
    """Change every value of `t` in place (its storage, as a reload's copy would)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point() and t.dtype.itemsize >= 2:
        before = t.clone()
        t.add_(1.0)
        # a value too large for +1 to change in its dtype (Marlin's exponent-biased scales
        # in bf16) is doubled instead
        t.copy_(torch.where(t == before, before * 2, t))
    else:
        flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        flat.bitwise_xor_(0x11)


def flip_test(kernel: str, sc, stale) -> str:
    """For each moved owner of a stale edge: change the live tensor's values; a graph that
    reads the captured storage replays the same output while eager code changes (the
    scenario's flip: a fresh replay and eager run are the baseline, restored after)."""
    from graphtrace.owners import resolve_path

    if stale.empty:
        return "n/a (no stale edge)"
    if kernel in NO_FLIP:
        return NO_FLIP[kernel]
    paths = sorted({p for owners in stale["owners"] for p in owners.split("; ") if p})
    if any(p.endswith("handler_tensor") for p in paths):
        # The captured int64 is a pointer to a native oneDNN primitive that the old handler's
        # __del__ released during the reload: replaying the graph dereferences freed memory
        # (a segfault in dnnl_helper.cpp, seen while writing this audit). Not replayed.
        return ("not replayed: the captured handle's oneDNN primitive was released by the "
                "reload (replay segfaults); vLLM's CPU platform captures no graphs (Findings)")
    results = []
    with torch.no_grad():
        for path in paths:
            live = resolve_path(sc.model, path)
            if live is None:
                results.append(f"{path}: orphaned")
                continue
            saved = []

            def perturb(m, live=live, saved=saved) -> None:
                saved.append(live.clone())              # the values the baselines saw
                _perturb(live)

            f = sc.flip(perturb, restore=lambda m, live=live, saved=saved: live.copy_(saved[0]),
                        eager=True)
            replay_changed, eager_changed = f.changed > 0, f.eager_changed > 0
            word = ("stale read confirmed" if eager_changed and not replay_changed else
                    "graph reads the live tensor" if replay_changed else "no effect on output")
            results.append(f"{path}: {word} (eager {'changed' if eager_changed else 'same'}, "
                           f"replay {'changed' if replay_changed else 'same'})")
    return "; ".join(results)


# Note [audit dangling sources]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The reload runs after the capturing trace is closed (the identity diff is of what the
# graph captured before it), inside a second trace with lineage and no capture region: it
# records which handles the reload's process step makes from which parameters, and
# `t.findings()` (Note [dangling sources] in graphtrace/lineage/handles.py) lists every live handle
# whose source was freed while the layer keeps that value in another storage. Such a row is
# `dangling-source:HOLDER <- SOURCE` among the row's stale owners. A source the layer
# dropped on purpose (vLLM sets the int8 weight to None once the oneDNN handler has
# prepacked it) is a `released source`, not listed. No graph is needed: vLLM's CPU
# platform captures none, and the CPU int8 handler's freed weight scale is read by every
# eager forward after the reload (analysis/repro/cpu_int8_scale_after_reload.py).

def reload_with_lineage(res: Outcome, sc, model, reload) -> None:
    """`sc.reload(reload)` inside a lineage trace; its dangling sources into `res.findings`
    (Note [audit dangling sources])."""
    import graphtrace as gt

    with gt.trace(model, strict=False) as lt:
        sc.reload(reload)
    found = lt.findings()
    res.findings += [("dangling-source", f"{r.holder} <- {r.source}", 0, "unknown")
                     for r in found.itertuples() if r.kind == "dangling source"]


FIELDS = ["kernel", "family", "source", "scheme", "ran", "failed_at", "reason", "stable",
          "stale", "dangling", "diverged", "orphaned", "unowned", "stale_owners",
          "vllm_source", "flip", "standins", "reload_dropped", "seconds"]


def rows(outcomes: list[Outcome]) -> list[dict]:
    out = []
    for r in outcomes:
        owners, sources = [], []
        for verdict, path, nbytes, impact in r.findings:
            for p in path.split("; "):
                owners.append(f"{verdict}:{p}")
                src = finding_source(r.kernel.name, p)
                sources.append(f"{src[0]}" if src else f"unchecked:{p}")
        row = {"kernel": r.kernel.name, "family": r.kernel.family, "source": r.kernel.source,
               "scheme": r.scheme, "ran": "yes" if r.ran else "no",
               "failed_at": r.stage, "reason": r.reason,
               **{v: int(r.edges.get(v, 0)) for v in
                  ("stable", "stale", "dangling", "diverged", "orphaned", "unowned")},
               "stale_owners": " | ".join(dict.fromkeys(owners)),
               "vllm_source": " | ".join(dict.fromkeys(sources)),
               "flip": r.flip, "standins": " ".join(r.standins),
               "reload_dropped": " ".join(r.dropped),
               "seconds": f"{r.seconds:.1f}"}
        out.append(row)
    return out


def write_csv(table: list[dict], path: Path) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    w.writeheader()
    for row in table:
        w.writerow({k: v for k, v in row.items() if k != "seconds"} | {"seconds": ""})
    write_results(path, buf.getvalue())


def _cell(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def write_markdown(table: list[dict], outcomes: list[Outcome], path: Path,
                   registered: list[str], elapsed: float, cpu: dict) -> None:
    ran = [r for r in table if r["ran"] == "yes"]
    asked = [(r.kernel.name, r.amx_asked) for r in outcomes if r.amx_asked]
    lines = [
        "# vLLM 0.32 linear kernels and fused-MoE methods on CPU: what a weight reload leaves stale",
        "",
        "Generated by `analysis/vllm_kernel_audit.py` (`make audit-vllm`); do not edit by hand.",
        f"Checkout {revision()}, vLLM {_vllm_version()}, torch {torch.__version__}, "
        f"amd-quark {_quark_version()}; linear kernel classes: "
        f"{sum(r['family'] != 'moe' for r in ran)} of "
        f"{sum(r['family'] != 'moe' for r in table)} ran through their real "
        f"create_weights / process_weights_after_loading / apply_weights and vLLM's layerwise "
        f"reload; fused-MoE quant methods: {sum(r['family'] == 'moe' for r in ran)} of "
        f"{sum(r['family'] == 'moe' for r in table)} ({elapsed:.0f} s). Stand-ins: "
        "analysis/vllm_audit_standins.py, listed per row.",
        "",
        f"CPU: {cpu['model']}; kind `{cpu['kind']}` (flags: "
        f"{', '.join(cpu['flags']) or 'none of amx_*, avx512*, avx2'}; "
        f"`torch.cpu._is_amx_tile_supported()` = {cpu['amx_tile_supported']}"
        + ("; AMX faked by the test hook" if cpu["faked_amx"] else "") + "). vLLM picks "
        "CPU code paths by AMX and by the build of its extension the CPU gets (Note [audit "
        "CPU paths]): the tests compare a CPU-dependent row only with results made on the same "
        "kind of CPU; the rows whose vLLM code asked the AMX question are listed under "
        "\"CPU-dependent rows\". Each row ran in a process of its own (Note [audit row "
        "isolation]).",
        "",
        "Each kernel: one `ColumnParallelLinear` (in 256, out 128, 4 tokens) with the scheme "
        "named, loaded through each parameter's `weight_loader`, processed, its apply captured "
        "with `gt.capture` under `gt.trace`, reloaded with new weights through "
        "`initialize_layerwise_reload` / weight loaders / `finalize_layerwise_reload`, then "
        "`t.diff()`; a flip test for every stale owner. CUDA-only `_C` ops the CPU build lacks "
        "ran as stand-ins registered under their real names (Note [audit stand-ins]): "
        + ", ".join(f"`{n}`" for n in registered) + ".",
        "",
        "## Findings",
        "",
    ]
    findings = [r for r in table if r["stale_owners"]]
    for name, (src, what) in RELOAD_FAILURES.items():
        row = next((r for r in table if r["kernel"] == name), None)
        if row is not None and row["ran"] == "no" and row["failed_at"] == "reload":
            lines.append(f"- **{name}** ({row['family']}): vLLM's reload raises "
                         f"({row['reason']})")
            lines.append(f"  - `{src}`: {what}.")
    if not findings and not RELOAD_FAILURES:
        lines.append("No stale-like edge (stale, dangling, diverged, unrefreshed) in any kernel that ran.")
    findings = [r for r in table if r["stale_owners"] or r["reload_dropped"]]
    for r in findings:
        lines.append(f"- **{r['kernel']}** ({r['family']}): {r['stale_owners'] or 'no stale edge'}")
        if r["reload_dropped"]:
            lines.append(f"  - `{RELOAD_DROP_SOURCE[0]}`: reload dropped "
                         f"`{r['reload_dropped']}`: {RELOAD_DROP_SOURCE[1]}.")
        sourced = dict.fromkeys(
            src for o in r["stale_owners"].split(" | ")
            if o and (src := finding_source(r["kernel"], o.split(":", 1)[1])) is not None)
        for src, what in sourced:
            lines.append(f"  - `{src}`: {what}.")
        lines.append(f"  - flip test: {r['flip']}")
    lines += ["", "## Published MoE bugs in vLLM 0.32's code", "",
              "Each read in the installed vLLM 0.32 source; `audit` says whether a row above "
              "exercised the code path.", ""]
    for bug, (status, where, audit) in PUBLISHED_MOE_BUGS.items():
        lines.append(f"- **{bug}**: {status} `{where}`. Audit: {audit}")
    lines += ["", "## Every kernel class", "",
              "| kernel | family | ran | stable | stale | dangling | diverged | orphaned | "
              "unowned | stale owners | vLLM source | stand-ins | why not run |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        why = f"{r['failed_at']}: {r['reason']}" if r["ran"] == "no" else ""
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{r['kernel']}`", r["family"], r["ran"], r["stable"], r["stale"], r["dangling"],
            r["diverged"], r["orphaned"], r["unowned"], r["stale_owners"], r["vllm_source"],
            r["standins"], why)) + " |")
    lines += ["", "## CPU-dependent rows", "",
              "Rows whose vLLM code asked `torch.cpu._is_amx_tile_supported()` (the last "
              "answer): on a CPU of another kind they may take another code path "
              "(Note [audit CPU paths]).", ""]
    lines += [f"- `{name}`: {answer}" for name, answer in asked] or ["- none"]
    lines += ["", "## Why the others did not run", ""]
    causes: dict[str, list[str]] = {}
    for r in table:
        if r["ran"] == "no":
            causes.setdefault(_cause(r["reason"]), []).append(r["kernel"])
    for cause, names in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {cause} ({len(names)}): {', '.join(names)}")
    write_results(path, "\n".join(lines) + "\n")


def write_cpu(cpu: dict, outcomes: list[Outcome], path: Path) -> None:
    """The CPU the results were made on and the rows that asked vLLM's AMX question, for the
    tests' comparison across machines (tests/vllm/test_kernel_audit.py)."""
    import json

    data = dict(cpu, amx_asked={r.kernel.name: r.amx_asked for r in outcomes if r.amx_asked})
    write_results(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def _cause(reason: str) -> str:
    m = re.match(r"crashed: (timed out|[A-Z]+|exit \d+)", reason)
    if m:
        return f"crashed its process ({m.group(1)}): Note [audit row isolation]"
    m = re.search(r"No module named '([\w.]+)'", reason)
    if m:
        return f"needs the `{m.group(1)}` package (not installed for CPU)"
    if "a bug on CPUs with AMX" in reason or "a bug on vLLM's CPU platform" in reason:
        return ("vLLM's code fails with its CPU experts, on the path an AMX CPU takes (Note "
                "[audit CPU experts]); its reason gives the lines")
    if "AMX probe: on a CPU with AMX vLLM's oracle picks CPUExperts" in reason:
        return ("no MoE backend on this CPU; with AMX vLLM's oracle picks its CPU experts "
                "(Note [audit AMX probe])")
    if "AMX probe:" in reason:
        return ("no MoE backend on this CPU, nor with AMX (Note [audit AMX probe]); its "
                "reason says what would run it")
    for pat, cause in ((r"FlashInfer", "needs FlashInfer"),
                       (r"DeepGEMM", "needs DeepGEMM"),
                       (r"punica_base\.py", "vLLM's CPU punica wrapper has no MoE LoRA"),
                       (r"only implemented in CUDA devices",
                        "amd-quark's MX-FP4 kernel is CUDA/HIP only"),
                       (r"amd-quark", "needs amd-quark"),
                       (r"not subscriptable|(?<!@)triton",
                        "launches a Triton kernel (no Triton here)"),
                       (r"'_OpNamespace' '(\w+)' object has no attribute '(\w+)'",
                        "calls an op of another platform's extension with no stand-in yet"),
                       (r"not compiled with (\w+)", "needs a device tensor"),
                       (r"scales must be on gpu", "asserts its tensors are on a GPU")):
        m = re.search(pat, reason)
        if m:
            return cause
    return "other: see the table"


# Note [audit CPU paths]
# ~~~~~~~~~~~~~~~~~~~~~~
# vLLM's CPU code chooses among paths by the CPU, in two ways (vLLM 0.32, read in the wheel):
# - by AMX (`torch.cpu._is_amx_tile_supported()`). CPUInt8ScaledMMLinearKernel takes the
#   sgl-kernels int8 GEMM (`convert_weight_packed`, `int8_scaled_mm_with_quant`) on x86 with
#   symmetric activations when `check_cpu_sgl_kernel(N, K, int8)` holds (kernels/linear/
#   scaled_mm/cpu.py:50-57): AMX, K % 32 == 0 and N % 16 == 0 (model_executor/layers/
#   utils.py:439-456); oneDNN otherwise. CPUWNA16LinearKernel asks for its ISA hint, "amx" only
#   for bfloat16 (kernels/linear/mixed_precision/cpu.py:211-213; W4A8 only with
#   VLLM_CPU_INT4_W4A8 and bfloat16, :168-174). The CPU FP8 kernels require AMX (scaled_mm/
#   cpu.py:241, :358, :453-455 and :610-612 with `cpu_has_amx_fp8`) and the CPU MoE experts
#   are offered only with AMX (fused_moe/experts/cpu_moe.py:326-330 unquantized, :456-460 FP8,
#   :624-628 MXFP4, :840-844 INT4, :999-1003 INT8).
# - by the extension build the platform loads (Note [audit CPU extension]): `_C_AVX2` has
#   neither the sgl-kernels (`convert_weight_packed`, used by every CPU FP8 kernel and by the
#   int8 kernel's AMX path) nor `cpu_gemm_wna16`, so those rows fail on an AVX2-only CPU.
# The audit answers `is_supported`/`can_implement` yes (forced()), so its shapes must meet the
# rules those checks and the native kernels enforce on every path, and they do: linear K=256,
# N=128, 4 tokens (N % 32 == 0 for the FP8 kernels, cpu.py:373, :630; FP8 blocks [128, 128]:
# K block 128 and N block a multiple of 32, cpu.py:253-263, :468-478; bfloat16 output, :263);
# int8 rows run with bfloat16 activations: the sgl int8 GEMM has an AVX-512 kernel for
# bfloat16 only, float16 reaches its scalar fallback, a TORCH_CHECK that aborts the process
# (`tinygemm_kernel_nn`, csrc/cpu/sgl-kernels/gemm_int8.cpp in the vllm-project/vllm
# repository; issue 29 saw it at :81), and its N tiles are 32 or 64 wide (N % 32 == 0);
# oneDNN takes bfloat16 on every x86 path. MoE: hidden 128, intermediate 128, bfloat16
# (the CPU experts want multiples of 32 and bfloat16 activations, cpu_moe.py:89, :112-131,
# :346-347, :1028-1031).
# Each row records whether its code asked the AMX question and the answer (Outcome.amx_asked,
# vllm_kernel_audit.cpu.json); the committed results name the kind of CPU they were made on
# (cpu_features); CPU_DEPENDENT lists the rows whose outcome depends on the CPU. The tests
# compare a row with committed results made on another kind of CPU only when both runs gave
# vLLM's AMX question the same answer (or neither asked it) and, for a row that needs ops of
# the AVX-512 build (BUILD_DEPENDENT), both CPUs load the same build (`comparable`). The main
# results (analysis/results/vllm_kernel_audit.*) are of one kind; rows that differ on another
# kind are compared with that kind's run in analysis/results/audit-cpu/<kind>/, where one is
# committed.


def _build(kind: str) -> str:
    return "avx2" if kind in ("avx2", "other") else "avx512"


def comparable(name: str, cpu: dict, other: dict) -> bool:
    """Whether `name`'s row made on `cpu` (a .cpu.json) must equal its row made on `other`:
    the same kind of CPU, or the same answer to vLLM's AMX question (or neither asked) and,
    for a row in BUILD_DEPENDENT, the same build of vLLM's extension (Note [audit CPU paths])."""
    if cpu["kind"] == other["kind"]:
        return True
    if cpu["amx_asked"].get(name) != other["amx_asked"].get(name):
        return False
    return name not in BUILD_DEPENDENT or _build(cpu["kind"]) == _build(other["kind"])


# ---------------------------------------------------------------------------------------------
# Isolation: each row in a process of its own (Note [audit row isolation])

# Note [audit row isolation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A row runs vLLM's real CPU ops wherever the CPU build has them (oneDNN, the sgl-kernels
# GEMMs, the CPU MoE experts), and a native failure there need not raise: on a CPU with AMX,
# `int8_scaled_mm_with_quant` with float16 activations reaches the scalar fallback of
# `tinygemm_kernel_nn` (csrc/cpu/sgl-kernels/gemm_int8.cpp:81), whose TORCH_CHECK ends the
# whole process with SIGABRT. So every row runs in a child process forked from the parent
# after vLLM is imported, the classes are discovered and the stand-ins are registered (a fork
# imports nothing again). The child writes each stage to a file as the row starts it
# (Outcome.stage), its stdout and stderr to a log, each answer vLLM got to
# `torch.cpu._is_amx_tile_supported()` to another file (vLLM's own calls only, _watch_amx),
# and its outcome to a pickle. A child that dies (a signal, or an exit without an outcome) is
# that row's result: `crashed: SIGABRT: <the native error's what(), else the last line of its
# stderr>`, at the stage it had reached, and the run goes on with the next row; a row still
# running after --row-timeout seconds is ended by SIGALRM (`crashed: timed out after N s`).
# Rows share no state any more: vLLM's module-level flags set by one row (e.g. humming.py's
# `_patched`) no longer change the next row's reason.
# GNU OpenMP's thread pool does not survive fork(): a child's first parallel op hangs if the
# parent ever ran one with several threads. main() therefore sets torch to one thread before
# anything runs, and each child restores the machine's count.
# Test hooks, read in the child: GRAPHTRACE_AUDIT_TEST_ABORT=<row>[:<stage>] makes that row
# call os.abort() when it reaches <stage> (default `select`); GRAPHTRACE_AUDIT_TEST_FAKE_AMX=1
# makes `torch.cpu._is_amx_tile_supported()` answer yes, as on a CPU with AMX, so vLLM takes
# its AMX code paths here (tests/vllm/test_kernel_audit.py).

TEST_ABORT_ENV = "GRAPHTRACE_AUDIT_TEST_ABORT"
TEST_FAKE_AMX_ENV = "GRAPHTRACE_AUDIT_TEST_FAKE_AMX"
ROW_TIMEOUT = 600


def cpu_features() -> dict:
    """The CPU the audit ran on: model name, the /proc/cpuinfo flags that decide vLLM's CPU
    code paths (amx_*, avx512*, avx2), what torch answers vLLM's AMX question with, and the
    kind (amx / avx512 / avx2 / other) that committed results are compared by."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    relevant = sorted(f for f in flags if f.startswith(("amx", "avx512")) or f == "avx2")
    amx = bool(torch.cpu._is_amx_tile_supported())
    kind = ("amx" if amx else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags
            else "other")
    return {"model": model, "kind": kind, "flags": relevant, "amx_tile_supported": amx,
            "faked_amx": os.environ.get(TEST_FAKE_AMX_ENV) == "1"}


def _stage_started(path: Path, kernel: str, stage: str) -> None:
    path.write_text(stage)
    name, _, at = os.environ.get(TEST_ABORT_ENV, "").partition(":")
    if name == kernel and (at or "select") == stage:
        print(f"audit test hook ({TEST_ABORT_ENV}): os.abort() in {kernel} at {stage}",
              file=sys.stderr, flush=True)
        os.abort()


def _watch_amx(path: Path) -> None:
    """Record each time vLLM asks `torch.cpu._is_amx_tile_supported()`, and the answer
    (yes when the fake-AMX test hook is set). Only vLLM's own calls count: torch's inductor
    asks too, to choose the vector ISA of the code it compiles for vLLM's torch.compile'd
    helpers (torch/_inductor/cpu_vec_isa.py), which changes no stale edge, and it gets the
    real answer even under the hook (AMX code on a CPU without AMX would be SIGILL)."""
    real = torch.cpu._is_amx_tile_supported
    fake = os.environ.get(TEST_FAKE_AMX_ENV) == "1"
    vllm_dir = os.sep + "vllm" + os.sep

    def is_amx_tile_supported() -> bool:
        if vllm_dir not in sys._getframe(1).f_code.co_filename:
            return bool(real())
        answer = True if fake else bool(real())
        with open(path, "a") as f:
            f.write(f"{answer}\n")
        return answer

    torch.cpu._is_amx_tile_supported = is_amx_tile_supported


def _row_child(k: KernelInfo, work: Path, threads: int, timeout: int) -> None:
    """The forked child: audit row `k`, pickle its outcome into `work`; never returns."""
    global _ROW_STAGE_HOOK
    code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        log = os.open(work / "log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(timeout)
        torch.set_num_threads(threads)
        _ROW_STAGE_HOOK = lambda name, stage: _stage_started(work / "stage", name, stage)  # noqa: E731
        _watch_amx(work / "amx")
        init_single_process_group()
        res = audit_moe(k) if k.family == "moe" else audit_kernel(k)
        data = {f.name: getattr(res, f.name) for f in fields(res) if f.name != "kernel"}
        (work / "outcome.pkl").write_bytes(pickle.dumps(data))
        code = 0
    except BaseException:  # noqa: BLE001 (the parent reports it as the row's crash)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_row(k: KernelInfo, threads: int, timeout: int = ROW_TIMEOUT) -> Outcome:
    """Audit one row in a child process (Note [audit row isolation]); a crash is its result."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-audit-row-") as tmp:
        work = Path(tmp)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _row_child(k, work, threads, timeout)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        asked = (work / "amx").read_text().split() if (work / "amx").exists() else []
        if code == 0 and (work / "outcome.pkl").exists():
            res = Outcome(k, **pickle.loads((work / "outcome.pkl").read_bytes()))
        else:
            stage = (work / "stage").read_text() if (work / "stage").exists() else "start"
            log = (work / "log").read_text(errors="replace") if (work / "log").exists() else ""
            res = Outcome(k, stage=stage, reason=crash_reason(code, log, timeout),
                          seconds=time.perf_counter() - t0)
    res.amx_asked = asked[-1] if asked else ""
    return res


def crash_reason(code: int, log: str, timeout: int) -> str:
    """`crashed: <signal or exit code>: <what the process said last>`."""
    if code < 0 and -code == signal.SIGALRM:
        return f"crashed: timed out after {timeout} s"
    how = signal.Signals(-code).name if code < 0 else f"exit {code}"
    return f"crashed: {how}: {last_error(log)}"


def last_error(log: str) -> str:
    """A native error's `what():` (with the source line it was raised at), else the last line
    the process wrote."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("what():"):
            what = lines[i][len("what():"):].strip()
            raised = next((line for line in lines[i + 1:i + 3]
                           if line.startswith("Exception raised from")), "")
            m = re.search(r"from (\w+) at .*?((?:csrc|aten|c10)/\S+:\d+)", raised)
            if m:
                what += f" (raised in {m.group(1)} at {m.group(2)})"
            return what[:300]
    return lines[-1][:300] if lines else "(no output)"


def note_forced_rows(outcomes: list[Outcome]) -> None:
    """A method's row that did not run names the rows of the same method that ran on a
    requested GPU backend (Note [audit MoE backends]): on a GPU with that backend vLLM runs it."""
    ran, cpu = {}, {}
    for r in outcomes:
        if r.ran and r.kernel.backend:
            (cpu if r.kernel.backend == "cpu" else ran).setdefault(
                r.kernel.method, []).append(r.kernel.name)
    for r in outcomes:
        if not r.ran and not r.kernel.backend and r.kernel.method in cpu:
            r.reason += ("; vLLM's CPU experts run it on this CPU when offered without AMX "
                         "(Note [audit CPU experts]): " + ", ".join(cpu[r.kernel.method]))
        if not r.ran and not r.kernel.backend and r.kernel.method in ran:
            r.reason += ("; on a GPU backend it runs: " + ", ".join(ran[r.kernel.method]))


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def _quark_version() -> str:
    """vLLM's MX emulation calls amd-quark (quantization/utils/mxfp6_utils.py, mxfp4_utils.py);
    without it those rows stop at apply, so the results name the version they ran with."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("amd-quark")
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", action="append", default=[],
                    help="audit only these kernel classes (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder for vllm_kernel_audit.md/.csv (default analysis/results)")
    ap.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    ap.add_argument("--row-timeout", type=int, default=ROW_TIMEOUT,
                    help=f"seconds a row may run before it is ended (default {ROW_TIMEOUT})")
    ap.add_argument("--in-process", action="store_true",
                    help="run every row in this process (for a debugger): a native crash then "
                         "ends the run (Note [audit row isolation])")
    args = ap.parse_args(argv)

    # before anything runs a parallel op: Note [audit row isolation]
    threads = torch.get_num_threads()
    if not args.in_process:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    cpu = cpu_features()
    if args.in_process:
        init_single_process_group()
    registered = install_standins()
    kernels = discover()
    if args.kernel:
        unknown = sorted(set(args.kernel) - {k.name for k in kernels}
                         - {k.name for k in discover_moe()})
        if unknown:
            ap.error(f"unknown kernel class(es): {', '.join(unknown)}")
        kernels = [k for k in kernels if k.name in args.kernel]
    moe_methods = discover_moe()
    if args.kernel:
        moe_methods = [k for k in moe_methods if k.name in args.kernel]
    todo = [*kernels, *moe_methods]
    print(f"CPU: {cpu['model']} ({cpu['kind']}: {' '.join(cpu['flags']) or 'no AVX2'})"
          + (" [AMX faked by test hook]" if cpu["faked_amx"] else "")
          + f"; {len(todo)} rows, each in a process of its own" * (not args.in_process),
          flush=True)
    outcomes = []
    t_rows = time.perf_counter()
    for i, k in enumerate(todo, 1):
        if args.in_process:
            r = audit_moe(k) if k.family == "moe" else audit_kernel(k)
        else:
            r = run_row(k, threads, args.row_timeout)
        outcomes.append(r)
        state = "ran" if r.ran else f"not run ({r.stage})"
        spent = time.perf_counter() - t0
        eta = (time.perf_counter() - t_rows) / i * (len(todo) - i)
        print(f"[{i:3d}/{len(todo)} {spent:4.0f}s, ~{eta:.0f}s left] {k.family:10s} "
              f"{k.name:48s} {state:32s} {r.edges} "
              f"{[f[1] for f in r.findings]}" + (f" {r.reason}" if not r.ran else ""),
              flush=True)
    note_forced_rows(outcomes)
    table = rows(outcomes)
    elapsed = time.perf_counter() - t0
    if not args.no_write:
        write_csv(table, args.out / "vllm_kernel_audit.csv")
        write_markdown(table, outcomes, args.out / "vllm_kernel_audit.md", registered, elapsed,
                       cpu)
        write_cpu(cpu, outcomes, args.out / "vllm_kernel_audit.cpu.json")
        print(f"wrote {args.out}/vllm_kernel_audit.md, .csv and .cpu.json")
    n_ran = sum(r.ran for r in outcomes)
    n_crashed = sum(r.reason.startswith("crashed:") for r in outcomes)
    print(f"{n_ran}/{len(outcomes)} kernel classes ran"
          + (f"; {n_crashed} crashed their process" if n_crashed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
