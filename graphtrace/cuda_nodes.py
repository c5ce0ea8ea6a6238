"""Read the kernel nodes of a captured CUDA graph through libcuda (ctypes; no torch).

A CUDA graph keeps, per kernel node, the argument values it was launched with: the ground
truth against which `graphtrace.coverage` measures which pointer arguments graphtrace
attributed. This module reads them: `CudaDriver().read_graph(g.raw_cuda_graph())` (a graph
captured with `torch.cuda.CUDAGraph(keep_graph=True)`) gives `coverage.KernelNode`s whose
words are each argument's pointer-sized values. The decoders (`decode_kernel_node_params`,
`kernel_param_words`, ...) take bytes and a memory reader, so they run on any machine;
`CudaDriver` needs libcuda and raises `LibcudaUnavailable` without it. Importing this
module needs neither torch nor CUDA. Struct layouts are those of the CUDA driver API on
x86-64 (little-endian, 8-byte pointers).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Callable

from graphtrace import coverage as _cov

__all__ = [
    "CudaDriver", "CudaDriverError", "LibcudaUnavailable", "NODE_TYPES", "decode_kernel_node_params",
    "decode_memcpy3d", "decode_memset", "parse_extra", "kernel_param_words", "read_host_memory",
]


class LibcudaUnavailable(RuntimeError):
    """No libcuda here (a machine without an NVIDIA driver), or one without the entry points
    needed to read graph nodes."""


class CudaDriverError(RuntimeError):
    """A libcuda call returned an error (the message names the call and the CUresult)."""


# CUgraphNodeType
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait",
              10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}
CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
MAX_PARAMS = 4096
FALLBACK_SPAN = 4096  # bytes scanned at most from the first parameter when sizes are unknown
SCAN_TAIL = 32       # bytes read from the last parameter's start when its size is unknown


def decode_kernel_node_params(buf: bytes) -> dict:
    """CUDA_KERNEL_NODE_PARAMS(_v2) as libcuda fills it (x86-64 layout):
    func @0, gridDim @8, blockDim @20, sharedMemBytes @32, kernelParams @40, extra @48,
    kern @56 and ctx @64 (v2 only)."""
    func, = struct.unpack_from("<Q", buf, 0)
    grid = struct.unpack_from("<3I", buf, 8)
    block = struct.unpack_from("<3I", buf, 20)
    shmem, = struct.unpack_from("<I", buf, 32)
    kparams, extra, kern, ctxp = struct.unpack_from("<4Q", buf, 40)
    return {"func": func, "grid": grid, "block": block, "shared_mem": shmem,
            "kernel_params": kparams, "extra": extra, "kern": kern, "ctx": ctxp}


def decode_memcpy3d(buf: bytes) -> list[int]:
    """Device addresses of a CUDA_MEMCPY3D (source and destination, byte offset applied)."""
    src_x, = struct.unpack_from("<Q", buf, 0)
    src_type, = struct.unpack_from("<I", buf, 32)
    src_dev, = struct.unpack_from("<Q", buf, 48)
    dst_x, = struct.unpack_from("<Q", buf, 88)
    dst_type, = struct.unpack_from("<I", buf, 120)
    dst_dev, = struct.unpack_from("<Q", buf, 136)
    out = []
    for kind, dev, x in ((src_type, src_dev, src_x), (dst_type, dst_dev, dst_x)):
        if kind in (2, 4) and dev:  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED
            out.append(dev + x)
    return out


def decode_memset(buf: bytes) -> list[int]:
    """The destination address of a CUDA_MEMSET_NODE_PARAMS (0: none)."""
    dst, = struct.unpack_from("<Q", buf, 0)
    return [dst] if dst else []


def parse_extra(read: Callable[[int, int], bytes], extra: int) -> tuple[int, int] | None:
    """The (buffer, size) a launch's `extra` array names (CU_LAUNCH_PARAM_BUFFER_*)."""
    buf = size = None
    for i in range(16):
        key, value = struct.unpack("<QQ", read(extra + 16 * i, 16))
        if key == CU_LAUNCH_PARAM_END:
            break
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
            buf = value
        elif key == CU_LAUNCH_PARAM_BUFFER_SIZE and value:
            size, = struct.unpack("<Q", read(value, 8))
    return (buf, size) if buf and size else None


def kernel_param_words(read: Callable[[int, int], bytes], kernel_params: int, extra: int,
                       param_info: list[tuple[int, int]] | None
                       ) -> tuple[list[tuple[int, int, int, bool]], str]:
    """Pointer-sized words of one kernel node's arguments, and how they were read.

    With `param_info` (offset, size per parameter, from cuFuncGetParamInfo): each argument
    is read at its size (`kernelParams[i]` points to its value; with an `extra` buffer, at
    its offset) and split by `coverage.param_words`. Without it, the argument block is
    scanned conservatively: `kernelParams[0]` is taken as the start of the driver's
    contiguous copy, the array is followed while its entries stay inside FALLBACK_SPAN
    bytes of it, and every aligned word up to SCAN_TAIL bytes past the last entry (same
    page) is a candidate.
    """
    if param_info is not None:
        blobs = []
        if kernel_params:
            for i, (_off, size) in enumerate(param_info):
                ptr, = struct.unpack("<Q", read(kernel_params + 8 * i, 8))
                blobs.append((i, read(ptr, size) if ptr and size else b""))
            return _cov.param_words(blobs), "param-info"
        if extra:
            found = parse_extra(read, extra)
            if found:
                buf, size = found
                data = read(buf, size)
                blobs = [(i, data[off:off + sz]) for i, (off, sz) in enumerate(param_info)]
                return _cov.param_words(blobs), "param-info+extra"
        return [], "no-params"
    if kernel_params:
        entries = []
        for i in range(MAX_PARAMS):
            p, = struct.unpack("<Q", read(kernel_params + 8 * i, 8))
            if p == 0 or (entries and not (entries[0] <= p < entries[0] + FALLBACK_SPAN)):
                break
            entries.append(p)
        if not entries:
            return [], "scan-empty"
        # the last argument's size is unknown: read SCAN_TAIL bytes past its start, but
        # never across a page boundary (an unmapped next page would be a crash)
        last = max(entries)
        end = min(last + SCAN_TAIL, (last // 4096 + 1) * 4096)
        end = max(end, last + 8)
        try:
            data = read(entries[0], end - entries[0])
        except Exception:  # noqa: BLE001 - a reader that can refuse (tests' fake memory)
            data = read(entries[0], last + 8 - entries[0])
        return [(0, off, v, True) for off, v in _cov.scan_words(data)], "scan"
    if extra:
        found = parse_extra(read, extra)
        if found:
            buf, size = found
            return [(0, off, v, True) for off, v in _cov.scan_words(read(buf, size))], "scan-extra"
    return [], "no-params"


def read_host_memory(addr: int, n: int) -> bytes:
    """`n` bytes of this process's memory at `addr` (where libcuda keeps node parameters)."""
    return ctypes.string_at(addr, n)


class CudaDriver:
    """The few libcuda entry points used to read a captured graph (ctypes, no bindings).

    `CudaDriver()` loads the system's libcuda (`path`: another library with the same entry
    points, e.g. a test's fake); raises LibcudaUnavailable when there is none.
    """

    def __init__(self, path: str | None = None):
        last = None
        for name in ((path,) if path else ("libcuda.so.1", "libcuda.so")):
            try:
                self.lib = ctypes.CDLL(name)
                self.path = name
                break
            except OSError as exc:
                last = exc
        else:
            raise LibcudaUnavailable(
                f"cannot read CUDA graph kernel nodes: libcuda (the NVIDIA driver library) "
                f"could not be loaded ({last}); this needs a machine with an NVIDIA driver")
        c_int, c_void_p, c_size_t, c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        P = ctypes.POINTER
        self.available: dict[str, bool] = {}

        def bind(names, argtypes, required=True):
            for n in names:
                fn = getattr(self.lib, n, None)
                if fn is not None:
                    fn.argtypes = argtypes
                    fn.restype = c_int
                    self.available[names[0]] = True
                    return fn
            self.available[names[0]] = False
            if required:
                raise LibcudaUnavailable(f"{self.path} has none of {names}: a driver too old "
                                         "to read CUDA graph nodes")
            return None

        self.cuDriverGetVersion = bind(["cuDriverGetVersion"], [P(c_int)])
        self.cuGetErrorName = bind(["cuGetErrorName"], [c_int, P(c_char_p)], required=False)
        self.cuGraphGetNodes = bind(["cuGraphGetNodes"], [c_void_p, P(c_void_p), P(c_size_t)])
        self.cuGraphNodeGetType = bind(["cuGraphNodeGetType"], [c_void_p, P(c_int)])
        self.cuGraphKernelNodeGetParams = bind(
            ["cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams"], [c_void_p, c_void_p])
        self.cuFuncGetName = bind(["cuFuncGetName"], [P(c_char_p), c_void_p], required=False)
        self.cuFuncGetParamInfo = bind(["cuFuncGetParamInfo"],
                                       [c_void_p, c_size_t, P(c_size_t), P(c_size_t)], required=False)
        self.cuKernelGetFunction = bind(["cuKernelGetFunction"], [P(c_void_p), c_void_p], required=False)
        self.cuKernelGetName = bind(["cuKernelGetName"], [P(c_char_p), c_void_p], required=False)
        self.cuGraphChildGraphNodeGetGraph = bind(["cuGraphChildGraphNodeGetGraph"],
                                                  [c_void_p, P(c_void_p)], required=False)
        self.cuGraphMemcpyNodeGetParams = bind(["cuGraphMemcpyNodeGetParams"], [c_void_p, c_void_p],
                                               required=False)
        self.cuGraphMemsetNodeGetParams = bind(["cuGraphMemsetNodeGetParams"], [c_void_p, c_void_p],
                                               required=False)
        self.errors: list[str] = []
        v = ctypes.c_int(0)
        self.check(self.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        self.version = v.value
        self.version_text = f"{v.value // 1000}.{(v.value % 1000) // 10}"

    def error_name(self, rc: int) -> str:
        if self.cuGetErrorName is None:
            return str(rc)
        s = ctypes.c_char_p()
        if self.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
            return f"{s.value.decode()} ({rc})"
        return str(rc)

    def check(self, rc: int, what: str) -> None:
        """Raise CudaDriverError naming the entry point and the driver's error when rc != 0."""
        if rc != 0:
            raise CudaDriverError(f"{what} failed: {self.error_name(rc)}")

    # -- graph walking -------------------------------------------------------------------
    def nodes(self, graph: int) -> list[int]:
        """The node handles of a CUgraph."""
        n = ctypes.c_size_t(0)
        self.check(self.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
        arr = (ctypes.c_void_p * max(n.value, 1))()
        self.check(self.cuGraphGetNodes(ctypes.c_void_p(graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
        return [int(arr[i] or 0) for i in range(n.value)]

    def node_type(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self.check(self.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        return t.value

    def func_name(self, func: int, kern: int) -> str:
        s = ctypes.c_char_p()
        if func and self.cuFuncGetName is not None:
            if self.cuFuncGetName(ctypes.byref(s), ctypes.c_void_p(func)) == 0 and s.value:
                return s.value.decode(errors="replace")
        if kern and self.cuKernelGetName is not None:
            if self.cuKernelGetName(ctypes.byref(s), ctypes.c_void_p(kern)) == 0 and s.value:
                return s.value.decode(errors="replace")
        return f"function@{func or kern:#x}"

    def param_info(self, func: int) -> list[tuple[int, int]] | None:
        if not func or self.cuFuncGetParamInfo is None:
            return None
        out = []
        off, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
        for i in range(MAX_PARAMS):
            rc = self.cuFuncGetParamInfo(ctypes.c_void_p(func), i, ctypes.byref(off), ctypes.byref(size))
            if rc != 0:
                # CUDA_ERROR_INVALID_VALUE (1) / NOT_FOUND (500) past the last parameter;
                # anything else on the first call: no information for this function
                if i == 0 and rc not in (1, 500):
                    return None
                break
            out.append((off.value, size.value))
        return out

    def read_graph(self, graph: int, read: Callable[[int, int], bytes] = read_host_memory,
                   depth: int = 0) -> tuple[list, dict]:
        """The nodes of a CUgraph handle (`CUDAGraph.raw_cuda_graph()`) as coverage.KernelNode
        (kernels, memcpys, memsets; child graphs flattened), and counts by node type and by
        how parameters were read. A node that cannot be read is counted under "errors" and
        described in `self.errors`; the rest are still read."""
        if depth == 0:
            self.errors = []
        nodes, counts = [], {}
        for node in self.nodes(graph):
            kind = NODE_TYPES.get(self.node_type(node), "other")
            counts[kind] = counts.get(kind, 0) + 1
            idx = len(nodes)
            if kind == "kernel":
                try:
                    buf = ctypes.create_string_buffer(512)
                    self.check(self.cuGraphKernelNodeGetParams(ctypes.c_void_p(node), buf),
                               "cuGraphKernelNodeGetParams")
                    p = decode_kernel_node_params(buf.raw)
                    func = p["func"]
                    if not func and p["kern"] and self.cuKernelGetFunction is not None:
                        f = ctypes.c_void_p()
                        if self.cuKernelGetFunction(ctypes.byref(f), ctypes.c_void_p(p["kern"])) == 0:
                            func = int(f.value or 0)
                    name = self.func_name(func, p["kern"])
                    info = self.param_info(func)
                    words, method = kernel_param_words(read, p["kernel_params"], p["extra"], info)
                    if info == [] and p["kernel_params"]:
                        method = "param-info-empty"  # no parameters, says the driver
                except Exception as exc:  # noqa: BLE001 - one unreadable node, not the graph
                    counts["errors"] = counts.get("errors", 0) + 1
                    self.errors.append(f"node {idx}: {type(exc).__name__}: {exc}")
                    continue
                counts[f"params:{method}"] = counts.get(f"params:{method}", 0) + 1
                nodes.append(_cov.KernelNode.from_words(name, words, node=idx))
            elif kind == "memcpy" and self.cuGraphMemcpyNodeGetParams is not None:
                buf = ctypes.create_string_buffer(512)
                if self.cuGraphMemcpyNodeGetParams(ctypes.c_void_p(node), buf) == 0:
                    nodes.append(_cov.KernelNode("memcpy", decode_memcpy3d(buf.raw), node=idx, kind="memcpy"))
            elif kind == "memset" and self.cuGraphMemsetNodeGetParams is not None:
                buf = ctypes.create_string_buffer(512)
                if self.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), buf) == 0:
                    nodes.append(_cov.KernelNode("memset", decode_memset(buf.raw), node=idx, kind="memset"))
            elif kind == "graph" and self.cuGraphChildGraphNodeGetGraph is not None and depth < 4:
                child = ctypes.c_void_p()
                if self.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(node), ctypes.byref(child)) == 0:
                    sub, sub_counts = self.read_graph(int(child.value or 0), read, depth + 1)
                    for n in sub:
                        n.node = len(nodes)
                        nodes.append(n)
                    for k, v in sub_counts.items():
                        counts[k] = counts.get(k, 0) + v
        return nodes, counts
