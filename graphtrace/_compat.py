"""Every private torch API graphtrace uses, in one place (Note [torch compatibility]).

graphtrace records through torch internals: the dispatch-mode stack, pytree, raw storage weak
handles, OpSchema types, Dynamo's and Inductor's classes. The rest of the package imports them
from here, under public names, and never from torch directly (tests/test_layers.py checks that).
This module looks each one up once, at import, and binds it: a hot path calls the very function
it called before (`storage_weak_ref(s)` is `torch.UntypedStorage._weak_ref`), with no layer
in between.

Note [torch compatibility]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Tested on torch `TESTED_TORCH` (pyproject's range: 2.11, 2.13, 2.14.1 and 2.15; the Makefile's
"torch range" block says which suites run on which torch).
What a torch outside it lacks is handled by what depends on it:

- recording itself (`TorchDispatchMode`, `disable_current_modes`, pytree, storage weak handles,
  `StorageBase._cdata`, schema types): nothing can be recorded without them, so importing this
  module raises `TorchIncompatible`, an ImportError naming each missing API. `import graphtrace`
  does not import torch, so reading reports (`gt.load_report`) still works.
- optional features fail open: their flag below is False, one `TorchCompatWarning` at import
  names what is missing and which feature is off, and the names they need are bound to
  stand-ins that raise `TorchIncompatible` with the same message if called anyway.
  `PROVENANCE` (creation sites, provenance.py: off by default then), `DYNAMO_CACHE` (which
  modules Dynamo compiled: attribution.py keeps forward wrappers off them), `SCRATCH` (storage
  use counts: emulated graphs keep their intermediates without them).
- Dynamo and Inductor classes (`load_compiled_fx_graph` and the like) are looked up when first
  needed, not here: importing torch._dynamo takes seconds, and a trace that never meets
  compiled code must not pay that. Their callers already fail open (a blind spot, or plain
  positions instead of Dynamo's names).
- `CAPTURE_HOOKS`: torch 2.14 made CUDA-graph lifecycle hooks public
  (`torch.cuda.graphs.register_graph_capture_start_hook` / `..._end_hook`); where they exist a
  trace learns of captures through them, elsewhere (2.11 to 2.13) it wraps
  `CUDAGraph.capture_begin/capture_end` (Note [CUDA graph capture hooks] in tracing/cudagraphs.py). Not a
  missing feature: no warning either way.
- `OP_CALLS_OP_DIRECTLY`: the native dispatch calls an OpOverload's `_op` itself only while
  `OpOverload.__call__` is exactly `return self._op(*args, **kwargs)` (torch 2.13); torch 2.14
  checks a Python dispatcher first, so there the native dispatch calls the OpOverload (the same
  records, one Python frame more per op).

One private attribute is read in place, not through here: `storage._cdata` (a StorageImpl's
address, the identity of every storage graphtrace records). It is read once per tensor per op
on the hot path, where a call would cost more than the read; this module checks that it
exists, and tests/test_layers.py allows that one attribute (with nn.Module's registries).
"""

from __future__ import annotations

import importlib
import inspect
import operator
import os
import sys
import warnings
from typing import Any, Callable

import torch

__all__ = [
    "CONSTANT_FOLDING",
    "TESTED_TORCH", "TorchIncompatible", "TorchCompatWarning", "missing",
    # recording (required)
    "TorchDispatchMode", "disable_current_modes", "is_traceable_wrapper_subclass",
    "tree_iter", "tree_map_only", "OpOverload", "JitType", "ClassType", "Argument",
    "op_schema", "storage_weak_ref", "weak_ref_expired", "free_weak_ref",
    "storage_from_weak_ref", "version_counter", "script_type_name",
    "dispatch_stack_len", "dispatch_stack_at",
    # provenance
    "PROVENANCE", "PROVENANCE_OFF", "current_dispatch_mode_stack", "push_mode", "pop_mode",
    # handle ops the dispatch mode cannot see (lineage)
    "HANDLE_OPS", "all_op_names", "has_kernel_for", "registrations_for",
    "function_stack_len", "function_stack_at",
    # emulated graphs let go of their intermediates
    "SCRATCH", "storage_use_count",
    # Dynamo's cache, a module call's frame (attribution)
    "DYNAMO_CACHE", "dynamo_cache_entries", "MODULE_CALL_CODE", "MODULE_FAST_PATH",
    "MODULE_WRAPPED_CALL_CODE",
    # how a trace learns of CUDA graph captures
    "CAPTURE_HOOKS",
    # the native dispatch
    "OP_CALLS_OP_DIRECTLY", "calls_op_directly",
    # looked up on first use (Dynamo, Inductor, the C++ extension builder)
    "load_compiled_fx_graph", "load_constant_makers", "load_output_graph", "load_caching_autotuner",
    "dynamo_skip_code", "extension_build_directory", "extension_build_directory_guess",
]

TESTED_TORCH = ">=2.11,<2.16"


class TorchIncompatible(ImportError):
    """This torch lacks a private API a graphtrace feature needs (Note [torch compatibility])."""


class TorchCompatWarning(RuntimeWarning):
    """An optional graphtrace feature is off: this torch lacks what it needs."""


_missing: dict[str, list[str]] = {}  # feature -> the torch APIs it lacks


def missing() -> dict[str, list[str]]:
    """Per graphtrace feature that is off on this torch, the torch APIs it lacks ({} on a
    tested torch)."""
    return {feature: list(apis) for feature, apis in _missing.items()}


def _message(feature: str) -> str:
    return (f"graphtrace: {feature} is off: torch {torch.__version__} lacks "
            f"{', '.join(_missing[feature])} (graphtrace is tested on torch {TESTED_TORCH})")


def _lookup(feature: str, path: str) -> Any:
    """`module.attr[.attr...]` under torch, or None (noted as missing for `feature`)."""
    module, _, attrs = path.partition(":")
    try:
        value = importlib.import_module(module)
        for attr in attrs.split(".") if attrs else ():
            value = getattr(value, attr)
        return value
    except (ImportError, AttributeError):
        _missing.setdefault(feature, []).append(f"{module}.{attrs}" if attrs else module)
        return None


def _unavailable(feature: str) -> Callable[..., Any]:
    def unavailable(*args, **kwargs):
        raise TorchIncompatible(_message(feature))

    return unavailable


# -- recording: required ----------------------------------------------------------------------
_REC = "recording"
TorchDispatchMode = _lookup(_REC, "torch.utils._python_dispatch:TorchDispatchMode")
disable_current_modes = _lookup(_REC, "torch.utils._python_dispatch:_disable_current_modes")
is_traceable_wrapper_subclass = _lookup(
    _REC, "torch.utils._python_dispatch:is_traceable_wrapper_subclass")
tree_iter = _lookup(_REC, "torch.utils._pytree:tree_iter")
tree_map_only = _lookup(_REC, "torch.utils._pytree:tree_map_only")
OpOverload = _lookup(_REC, "torch._ops:OpOverload")
JitType = _lookup(_REC, "torch._C:Type")  # (named JitType in torch's stubs only)
ClassType = _lookup(_REC, "torch._C:ClassType")
Argument = _lookup(_REC, "torch._C:Argument")
# the raw weak handle of a storage (an int: its StorageImpl's address, kept allocated while
# held), whether it expired, its release, and a strong storage back from a live one
storage_weak_ref = _lookup(_REC, "torch:UntypedStorage._weak_ref")
weak_ref_expired = _lookup(_REC, "torch:UntypedStorage._expired")
free_weak_ref = _lookup(_REC, "torch:UntypedStorage._free_weak_ref")
storage_from_weak_ref = _lookup(_REC, "torch:UntypedStorage._new_with_weak_ptr")
_lookup(_REC, "torch._C:StorageBase._cdata")  # read in place (see above): only checked
# which recording mode is on top of this thread's dispatch stack (recorder, compiled regions)
dispatch_stack_len = _lookup(_REC, "torch._C:_len_torch_dispatch_stack")
dispatch_stack_at = _lookup(_REC, "torch._C:_get_dispatch_stack_at")
_lookup(_REC, "torch._C:TensorBase._version")
_lookup(_REC, "torch._C:FunctionSchema")
if _REC in _missing:
    raise TorchIncompatible(
        f"graphtrace cannot record on torch {torch.__version__}: it lacks "
        f"{', '.join(_missing[_REC])} (graphtrace is tested on torch {TESTED_TORCH}; reports "
        "can still be read without recording: graphtrace.load_report)")

op_schema = operator.attrgetter("_schema")      # an OpOverload's FunctionSchema
version_counter = operator.attrgetter("_version")  # a tensor's in-place version counter


def script_type_name(obj: torch.ScriptObject) -> str:
    """A ScriptObject's TorchScript class name (`__torch__.torch.classes.ns.Name`)."""
    return obj._type().qualified_name()


def _optional(feature: str, *paths: str) -> tuple:
    """An optional feature's torch APIs, looked up together: (whether all exist, then each
    API, or each its stand-in when one is missing: Note [torch compatibility])."""
    apis = [_lookup(feature, path) for path in paths]
    if feature in _missing:
        return (False, *[_unavailable(feature)] * len(paths))
    return (True, *apis)


# -- provenance: optional ---------------------------------------------------------------------
_PROV = "provenance (creation sites of storages made outside captures)"
PROVENANCE, current_dispatch_mode_stack, push_mode, pop_mode = _optional(
    _PROV, "torch.utils._python_dispatch:_get_current_dispatch_mode_stack",
    "torch.utils._python_dispatch:_push_mode", "torch.utils._python_dispatch:_pop_mode")
PROVENANCE_OFF = "" if PROVENANCE else _message(_PROV)  # why, where it is off

# -- handle ops the dispatch mode cannot see: optional (Note [dangling sources]) --------------
(HANDLE_OPS, all_op_names, has_kernel_for, registrations_for, function_stack_len,
 function_stack_at) = _optional(
    "handles made by ops with a composite kernel (lineage's handle mode: vLLM's "
    "`_C::create_onednn_scaled_mm_handler`)",
    "torch._C:_dispatch_get_all_op_names", "torch._C:_dispatch_has_kernel_for_dispatch_key",
    "torch._C:_dispatch_get_registrations_for_dispatch_key",
    "torch._C:_len_torch_function_stack", "torch._C:_get_function_stack_at")

# -- storage use counts: optional -------------------------------------------------------------
SCRATCH, storage_use_count = _optional(
    "emulated graphs letting go of their intermediates (without it they keep every storage "
    "their ops saw)", "torch._C:_storage_Use_Count")

# -- Dynamo's code cache: optional ------------------------------------------------------------
DYNAMO_CACHE, dynamo_cache_entries = _optional(
    "which modules Dynamo compiled (forward wrappers may make modules compiled before the "
    "trace recompile)", "torch._C._dynamo.eval_frame:_debug_get_cache_entry_list")

# the code of `nn.Module._call_impl`: a frame running it is a module call (attribution's seed;
# None where torch has no such method: no module is found running then)
MODULE_CALL_CODE = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
# the code of `nn.Module.__call__`: a frame running it that calls no `_call_impl` frame is a
# module call through graphtrace's native `_call_impl` (Note [native module call])
MODULE_WRAPPED_CALL_CODE = getattr(getattr(torch.nn.Module, "_wrapped_call_impl", None),
                                   "__code__", None)


def _module_fast_path() -> tuple | None:
    """What `nn.Module._call_impl` reads to take its fast path: (the method itself, the JIT
    tracing check, its four global hook tables: dicts torch fills and empties in place, never
    rebinds), for attribution's one-frame call (Note [one frame per module call] in
    graphtrace/attribution.py); None where this torch lacks one of them (no one-frame call)."""
    try:
        from torch.nn.modules import module

        return (getattr(torch.nn.Module, "_call_impl"), torch._C._get_tracing_state,
                (module._global_forward_pre_hooks, module._global_forward_hooks,
                 module._global_backward_pre_hooks, module._global_backward_hooks))
    except AttributeError:
        return None


MODULE_FAST_PATH = _module_fast_path()


# -- CUDA graph capture hooks: public since torch 2.14 ---------------------------------------
def _capture_hooks() -> tuple[Callable, Callable] | None:
    """torch's (register_graph_capture_start_hook, register_graph_capture_end_hook), each
    `fn(graph) -> RemovableHandle`, or None where this torch has not both (wrap instead)."""
    graphs = importlib.import_module("torch.cuda.graphs")  # in every torch, CPU builds too
    start = getattr(graphs, "register_graph_capture_start_hook", None)
    end = getattr(graphs, "register_graph_capture_end_hook", None)
    return (start, end) if callable(start) and callable(end) else None


CAPTURE_HOOKS = _capture_hooks()


# -- the native dispatch's direct call --------------------------------------------------------
def calls_op_directly(cls: type) -> bool:
    """Is `cls.__call__` exactly `return self._op(*args, **kwargs)` (torch's OpOverload)? Then
    the native dispatch may call `_op` itself (Note [native dispatch]); a torch whose
    `__call__` does more keeps its own."""
    def reference(self, /, *args, **kwargs):
        return self._op(*args, **kwargs)

    code = getattr(getattr(cls, "__call__", None), "__code__", None)
    want = reference.__code__
    signature = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS  # (not CO_NESTED: where defined)
    return (code is not None and code.co_code == want.co_code and code.co_names == want.co_names
            and code.co_posonlyargcount == want.co_posonlyargcount
            and code.co_argcount == want.co_argcount
            and code.co_flags & signature == want.co_flags & signature)


OP_CALLS_OP_DIRECTLY = calls_op_directly(OpOverload)


# -- looked up on first use -------------------------------------------------------------------
def load_compiled_fx_graph() -> type:
    """Inductor's compiled graph (`__call__` is a compiled region's boundary). Imports
    Inductor; raises ImportError or AttributeError where this torch has no such class."""
    from torch._inductor.output_code import CompiledFxGraph

    return CompiledFxGraph


#: The module `load_constant_makers` imports first (already imported: Inductor is in use).
CONSTANT_FOLDING = "torch._inductor.constant_folding"


def load_constant_makers() -> list:
    """The Inductor modules whose `replace_node_with_constant` makes each compiled-in constant
    (freezing's parameters, constant folding's folded and prepacked values)."""
    import torch._inductor.constant_folding as constant_folding
    import torch._inductor.freezing as freezing

    return [m for m in (constant_folding, freezing)
            if callable(m.__dict__.get("replace_node_with_constant"))]


def load_output_graph() -> type:
    """Dynamo's OutputGraph (`call_user_compiler` sees the graph's input names)."""
    from torch._dynamo.output_graph import OutputGraph

    return OutputGraph


def load_caching_autotuner() -> type:
    """Inductor's Triton launcher (`run` is one kernel launch)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return CachingAutotuner


def dynamo_skip_code(code) -> None:
    """Tell Dynamo to run `code`'s frames as they are (and look at the frames they call)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


def extension_build_directory(name: str) -> str:
    """The folder torch's C++ extension builder uses for the extension `name` (made if
    missing). Importing the builder imports setuptools (~0.1 s): see the guess below."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def extension_build_directory_guess(name: str) -> str:
    """Where torch's builder puts `name`, worked out without importing it (nothing made):
    `TORCH_EXTENSIONS_DIR`, else torch's user cache folder plus `py<ver>_<accelerator>`, the
    rule of torch 2.13 and 2.14 (`_get_build_directory`). Only a guess to look for an
    already built file in; a wrong guess costs the builder's import, not a wrong module
    (tests/test_native.py compares it with the builder's answer)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch._appdirs import user_cache_dir

        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")),
                            f"{version}_{accelerator}")
    return os.path.join(root, name)


for _feature in _missing:
    warnings.warn(_message(_feature), TorchCompatWarning, stacklevel=2)
