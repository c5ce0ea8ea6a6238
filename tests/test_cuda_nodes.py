"""graphtrace.cuda_nodes without a GPU: the decoders on fake memory, the ctypes reader
against a fake libcuda built here with the C compiler, and the error without libcuda."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import pytest

from graphtrace import coverage as cov
from graphtrace import cuda_nodes as cn


def test_imports_without_torch_and_cuda():
    code = ("import sys, graphtrace.cuda_nodes as c; "
            "assert 'torch' not in sys.modules, 'cuda_nodes imported torch'; print(c.__all__[0])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "CudaDriver"


def test_missing_libcuda_is_a_clear_error(tmp_path):
    with pytest.raises(cn.LibcudaUnavailable, match=r"libcuda \(the NVIDIA driver library\) could "
                                                    r"not be loaded .*NVIDIA driver"):
        cn.CudaDriver(str(tmp_path / "libcuda-missing.so"))


def test_library_without_entry_points_is_a_clear_error():
    libc = "libc.so.6"
    try:
        import ctypes

        ctypes.CDLL(libc)
    except OSError:
        pytest.skip("no libc.so.6 to stand in for a libcuda without graph entry points")
    with pytest.raises(cn.LibcudaUnavailable, match="has none of .*cuDriverGetVersion"):
        cn.CudaDriver(libc)


class FakeMemory:
    """A sparse byte-addressable memory for exercising the kernel-node decoder on a CPU."""

    def __init__(self):
        self.blocks: dict[int, bytes] = {}

    def put(self, addr: int, data: bytes) -> int:
        self.blocks[addr] = bytes(data)
        return addr

    def read(self, addr: int, n: int) -> bytes:
        for base, data in self.blocks.items():
            if base <= addr and addr + n <= base + len(data):
                return data[addr - base: addr - base + n]
        raise MemoryError(f"read of {n} bytes at {addr:#x} outside fake memory")


def synthetic_kernel_node(mem: FakeMemory, args: list[tuple[str, int]], base: int = 0x10000,
                          array_at: int = 0x20000, struct_at: int = 0x30000) -> tuple[bytes, list]:
    """Lay out a kernel's arguments as the driver keeps them (contiguous, naturally aligned,
    `kernelParams[i]` pointing at each) and a CUDA_KERNEL_NODE_PARAMS_v2 naming them.
    args: (ctype, value) with ctype in {"ptr", "i32", "struct2"} (struct2: two pointers)."""
    blob, offsets, info = b"", [], []
    for kind, value in args:
        size = {"ptr": 8, "i32": 4, "struct2": 16}[kind]
        align = 8 if kind != "i32" else 4
        blob += b"\0" * (-len(blob) % align)
        offsets.append(len(blob))
        info.append((len(blob), size))
        if kind == "ptr":
            blob += struct.pack("<Q", value)
        elif kind == "i32":
            blob += struct.pack("<i", value)
        else:
            blob += struct.pack("<QQ", value[0], value[1])
    blob += b"\0" * (-len(blob) % 8)
    mem.put(base, blob)
    mem.put(array_at, b"".join(struct.pack("<Q", base + o) for o in offsets) + b"\0" * 8)
    params = struct.pack("<Q3I3II", 0xF00D, 1, 1, 1, 128, 1, 1, 0) + b"\0" * 4
    params += struct.pack("<4Q", array_at, 0, 0, 0)
    return params, info


def test_kernel_param_words_with_info_scan_and_extra():
    mem = FakeMemory()
    W, X, OUT = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000
    raw, info = synthetic_kernel_node(mem, [("ptr", W), ("i32", 7), ("struct2", (X, OUT))])
    p = cn.decode_kernel_node_params(raw)
    assert p["grid"] == (1, 1, 1) and p["block"] == (128, 1, 1) and p["func"] == 0xF00D
    words, method = cn.kernel_param_words(mem.read, p["kernel_params"], p["extra"], info)
    assert method == "param-info"
    assert words == [(0, 0, W, False), (2, 0, X, True), (2, 8, OUT, True)]
    words, method = cn.kernel_param_words(mem.read, p["kernel_params"], p["extra"], None)
    assert method == "scan" and [w[2] for w in words][:3] == [W, 7, X]  # last size unknown
    assert all(w[3] for w in words)
    # an `extra` launch: one buffer, (key, value) pairs, size behind a pointer
    buf = mem.put(0x40000, struct.pack("<QQQ", W, X, OUT))
    size_at = mem.put(0x41000, struct.pack("<Q", 24))
    extra = mem.put(0x42000, struct.pack("<6Q", 1, buf, 2, size_at, 0, 0))
    words, method = cn.kernel_param_words(mem.read, 0, extra, [(0, 8), (8, 8), (16, 8)])
    assert method == "param-info+extra" and [w[2] for w in words] == [W, X, OUT]
    words, method = cn.kernel_param_words(mem.read, 0, extra, None)
    assert method == "scan-extra" and [w[2] for w in words] == [W, X, OUT]
    assert cn.kernel_param_words(mem.read, 0, 0, None) == ([], "no-params")


def test_memcpy_and_memset_decoding():
    m = bytearray(200)
    struct.pack_into("<Q", m, 0, 16)            # srcXInBytes
    struct.pack_into("<I", m, 32, 2)            # CU_MEMORYTYPE_DEVICE
    struct.pack_into("<Q", m, 48, 0x1000)       # srcDevice
    struct.pack_into("<I", m, 120, 1)           # dst: host memory, not a device pointer
    struct.pack_into("<Q", m, 136, 0x2000)
    assert cn.decode_memcpy3d(bytes(m)) == [0x1010]
    assert cn.decode_memset(struct.pack("<Q", 0x3000) + bytes(32)) == [0x3000]


FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <string.h>
#include <stddef.h>
/* graphs 0x1000 (main) and 0x2000 (a child graph); nodes are small integers */
static unsigned char blob1[48];
static void *kparams1[4];
static unsigned char blob2[16];
static void *kparams2[2];
static int ready = 0;
static void setup(void) {
    if (ready) return;
    uint64_t w = 0x7f0000000000ULL, x = 0x7f0000100000ULL, out = 0x7f0000200000ULL;
    int32_t n = 64; uint64_t s = 12345;
    memcpy(blob1 + 0, &w, 8); memcpy(blob1 + 8, &n, 4);
    memcpy(blob1 + 16, &x, 8); memcpy(blob1 + 24, &out, 8); memcpy(blob1 + 32, &s, 8);
    kparams1[0] = blob1; kparams1[1] = blob1 + 8; kparams1[2] = blob1 + 16; kparams1[3] = blob1 + 32;
    uint64_t tmp = 0x7f0000300000ULL, x8 = x + 8;
    memcpy(blob2, &tmp, 8); memcpy(blob2 + 8, &x8, 8);
    kparams2[0] = blob2; kparams2[1] = blob2 + 8;
    ready = 1;
}
int cuDriverGetVersion(int *v) { *v = 12080; return 0; }
int cuGetErrorName(int rc, const char **s) { *s = rc == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN"; return 0; }
int cuGraphGetNodes(void *g, void **nodes, size_t *n) {
    static const uintptr_t main_nodes[] = {1, 2, 3, 4, 6};
    static const uintptr_t child_nodes[] = {5};
    const uintptr_t *list; size_t count;
    if ((uintptr_t)g == 0x1000) { list = main_nodes; count = 5; }
    else if ((uintptr_t)g == 0x2000) { list = child_nodes; count = 1; }
    else return 400;
    if (nodes) { size_t k = *n < count ? *n : count; for (size_t i = 0; i < k; i++) nodes[i] = (void *)list[i]; }
    *n = count; return 0;
}
int cuGraphNodeGetType(void *node, int *t) {
    switch ((uintptr_t)node) { case 1: case 5: *t = 0; break; case 2: *t = 1; break;
        case 3: *t = 2; break; case 4: *t = 4; break; default: *t = 5; }
    return 0;
}
int cuGraphKernelNodeGetParams_v2(void *node, void *p) {
    setup();
    unsigned char *b = p; memset(b, 0, 72);
    uint32_t grid[3] = {2, 1, 1}, block[3] = {128, 1, 1};
    memcpy(b + 8, grid, 12); memcpy(b + 20, block, 12);
    if ((uintptr_t)node == 1) { uint64_t f = 0xF1; void *kp = kparams1; memcpy(b, &f, 8); memcpy(b + 40, &kp, 8); }
    else if ((uintptr_t)node == 5) { uint64_t k = 0xA1; void *kp = kparams2; memcpy(b + 56, &k, 8); memcpy(b + 40, &kp, 8); }
    else return 1;
    return 0;
}
int cuFuncGetName(const char **name, void *f) {
    if ((uintptr_t)f == 0xF1) { *name = "_ZN2at6native29vectorized_elementwise_kernelILi4EEEvv"; return 0; }
    if ((uintptr_t)f == 0xF2) { *name = "triton_poi_fused_gelu_mul_0"; return 0; }
    return 1;
}
#ifndef NO_PARAM_INFO
int cuFuncGetParamInfo(void *f, size_t i, size_t *off, size_t *size) {
    static const size_t o1[] = {0, 8, 16, 32}, s1[] = {8, 4, 16, 8};
    if ((uintptr_t)f == 0xF1 && i < 4) { *off = o1[i]; *size = s1[i]; return 0; }
    if ((uintptr_t)f == 0xF2 && i < 2) { *off = 8 * i; *size = 8; return 0; }
    return 1;
}
#endif
int cuKernelGetFunction(void **f, void *k) { if ((uintptr_t)k != 0xA1) return 1; *f = (void *)0xF2; return 0; }
int cuGraphChildGraphNodeGetGraph(void *node, void **g) { if ((uintptr_t)node != 4) return 1; *g = (void *)0x2000; return 0; }
int cuGraphMemcpyNodeGetParams(void *node, void *p) {
    unsigned char *b = p; memset(b, 0, 200);
    uint64_t sx = 16, src = 0x7f0000100000ULL, dst = 0x7f0000200000ULL; uint32_t dev = 2;
    memcpy(b, &sx, 8); memcpy(b + 32, &dev, 4); memcpy(b + 48, &src, 8);
    memcpy(b + 120, &dev, 4); memcpy(b + 136, &dst, 8); return 0;
}
int cuGraphMemsetNodeGetParams(void *node, void *p) {
    unsigned char *b = p; memset(b, 0, 40); uint64_t d = 0x7f0000300000ULL; memcpy(b, &d, 8); return 0;
}
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    d = tmp_path_factory.mktemp("fakecuda")
    src = d / "fake_libcuda.c"
    src.write_text(FAKE_LIBCUDA)
    libs = {}
    for name, flags in (("full", []), ("noinfo", ["-DNO_PARAM_INFO"])):
        so = d / f"libcuda_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", *flags, "-o", str(so), str(src)], check=True)
        libs[name] = str(so)
    return libs


def test_ctypes_reader_on_fake_libcuda(fake_libcuda):
    drv = cn.CudaDriver(fake_libcuda["full"])
    assert drv.version == 12080 and drv.version_text == "12.8"
    assert drv.available["cuFuncGetParamInfo"] and drv.available["cuGraphKernelNodeGetParams_v2"]
    assert drv.available["cuKernelGetName"] is False  # optional, absent here
    nodes, counts = drv.read_graph(0x1000)
    assert counts == {"kernel": 2, "memcpy": 1, "memset": 1, "graph": 1, "empty": 1,
                      "params:param-info": 2}
    by_name = {n.name: n for n in nodes}
    W, X, OUT, TMP = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000, 0x7F0000300000
    k1 = by_name["_ZN2at6native29vectorized_elementwise_kernelILi4EEEvv"]
    assert list(k1.values) == [W, X, OUT, 12345]
    assert list(k1.params) == [0, 2, 2, 3] and list(k1.scanned) == [False, True, True, False]
    assert list(by_name["memcpy"].values) == [X + 16, OUT]
    assert list(by_name["memset"].values) == [TMP]
    triton = by_name["triton_poi_fused_gelu_mul_0"]  # child graph, function found via its CUkernel
    assert list(triton.values) == [TMP, X + 8]
    assert sorted(n.node for n in nodes) == list(range(len(nodes)))
    with pytest.raises(cn.CudaDriverError, match="cuGraphGetNodes failed: CUDA_ERROR_UNKNOWN"):
        drv.nodes(0x3000)


def test_ctypes_reader_without_param_info_scans(fake_libcuda):
    drv = cn.CudaDriver(fake_libcuda["noinfo"])
    assert drv.available["cuFuncGetParamInfo"] is False
    nodes, counts = drv.read_graph(0x1000)
    assert counts["params:scan"] == 2
    k1 = [n for n in nodes if n.name.startswith("_ZN")][0]
    assert {0x7F0000000000, 0x7F0000100000, 0x7F0000200000, 12345} <= set(k1.values)
    assert all(k1.scanned)


def test_coverage_of_fake_graph(fake_libcuda):
    import pandas as pd

    nodes, _ = cn.CudaDriver(fake_libcuda["full"]).read_graph(0x1000)
    storages = pd.DataFrame({"storage_id": [0, 1, 2], "data_ptr": [0x7F0000000000, 0x7F0000100000,
                                                                  0x7F0000200000],
                             "nbytes": [4096, 4096, 4096], "alive": [True, True, True]})
    accesses = pd.DataFrame({"graph_id": [0, 0, 0], "storage_id": [0, 1, 2],
                             "access": ["read", "read", "write"]})
    owned = pd.DataFrame({"data_ptr": [0x7F0000000000, 0x7F0000300000], "nbytes": [4096, 64],
                          "label": ["fc.weight", "act_perm.keywords['index']"]})
    res = cov.graph_coverage(nodes, storages, accesses, 0, owned=owned)
    t = res.totals
    # gemm-like: W, X, OUT; memcpy: X, OUT; memset: TMP (owned, unseen); triton: TMP, X
    assert (t["pointers"], t["attributed"], t["owned"], t["owned_attributed"]) == (8, 6, 3, 1)
    assert t["unseen_owners"] == "act_perm.keywords['index']"


def test_decoded_node_through_coverage_arithmetic():
    """A decoded node's words, with a Triton-like node, through graph_coverage: what the
    dispatcher attributed, what a launch hook adds, which owned storage nobody saw."""
    import pandas as pd

    mem = FakeMemory()
    W, X, OUT, TMP = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000, 0x7F0000300000
    raw, info = synthetic_kernel_node(mem, [("ptr", W), ("i32", 64), ("struct2", (X, OUT)),
                                            ("ptr", 12345)])
    p = cn.decode_kernel_node_params(raw)
    words, method = cn.kernel_param_words(mem.read, p["kernel_params"], p["extra"], info)
    assert method == "param-info" and [w[2] for w in words] == [W, X, OUT, 12345]
    storages = pd.DataFrame({"storage_id": [0, 1, 2], "data_ptr": [W, X, OUT],
                             "nbytes": [4096, 1024, 1024], "device": ["cuda:0"] * 3,
                             "alive": [True, True, True], "first_access": ["read"] * 3})
    accesses = pd.DataFrame({"graph_id": [0, 0], "storage_id": [0, 2],
                             "access": ["read", "write"], "graph": ["g", "g"]})
    owned = pd.DataFrame({"data_ptr": [W, TMP], "nbytes": [4096, 256],
                          "label": ["fc.weight", "act_perm.keywords['index']"]})
    hook = pd.DataFrame({"data_ptr": [TMP, X], "nbytes": [256, 1024],
                         "label": ["t:in_ptr1", "t:in_ptr0"]})
    nodes = [cov.KernelNode.from_words("gemm", words),
             cov.KernelNode("triton_poi_fused_0", [X + 8, TMP, OUT])]
    t = cov.graph_coverage(nodes, storages, accesses, 0, owned=owned, hook=hook).totals
    assert (t["pointers"], t["attributed"], t["attributed_with_hook"], t["owned"],
            t["owned_attributed"]) == (6, 3, 6, 2, 1)
    assert t["unseen_owners"] == "act_perm.keywords['index']"
