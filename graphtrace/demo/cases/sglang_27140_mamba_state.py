"""SGLang #27140: a hybrid (Mamba) model's state buffers freed and reallocated by a
memory-saver pause/resume, under graphs that still read them.

Real code: SGLang's hybrid models keep the recurrent state in the request pool's Mamba pool
(`python/sglang/srt/mem_cache/memory_pool.py`: `MambaPool`, `conv_state` / `ssm_state`),
and the Mamba layers read and update them in the captured decode graphs. In colocated RL
the engine is paused and resumed (`release_memory_occupation` / `resume_memory_occupation`,
through `torch_memory_saver`); where those buffers were freed and allocated again rather
than kept at the same virtual address, the decode graphs kept the capture-time addresses of
freed memory. No weights are involved; the thread's fix is to re-capture.

`fixed` keeps the buffers in the memory saver's region: the pause discards the contents and
the resume restores the same storages (zeroed here), which is what makes graphs survive it.

Dangling on CPU: an emulated graph keeps the storages it captured alive (as capture
artifacts can), which would turn this into `stale`. The captures here are recorded
without an emulated graph (`gt.capture(label, emulate=False)`), as a real CUDA graph holds
addresses and no tensors, so the freed state is `dangling`; there is nothing to replay and
no flip test. On CUDA the caching allocator usually hands the freed address straight back
to the new buffer, so a replay can even read the right memory by luck; graphtrace keys
storages by identity, not address, and still says `dangling`.
"""

from __future__ import annotations

import torch

from .harness import CaseModel
from .spec import Case, buggy_and_fixed

__all__ = [
    "BATCH_SIZES", "MambaPool", "MambaMixer", "HybridModel", "pause_resume", "run", "POOL",
    "CASE"
]

D_INNER, D_CONV, D_STATE, MAX_REQS = 8, 4, 4, 4
BATCH_SIZES = (1, 2)


class MambaPool:
    """The request pool's Mamba state: one conv and one ssm state per layer and slot."""

    def __init__(self, n_layers: int, in_saver_region: bool):
        self.in_saver_region = in_saver_region
        self.conv_state = torch.zeros(n_layers, MAX_REQS, D_INNER, D_CONV)
        self.ssm_state = torch.zeros(n_layers, MAX_REQS, D_INNER, D_STATE)

    def pause(self):
        if not self.in_saver_region:
            self.conv_state = self.ssm_state = None  # freed

    def resume(self, n_layers: int):
        if self.in_saver_region:  # same storages, contents discarded
            self.conv_state.zero_()
            self.ssm_state.zero_()
        else:  # allocated again: new storages
            self.conv_state = torch.zeros(n_layers, MAX_REQS, D_INNER, D_CONV)
            self.ssm_state = torch.zeros(n_layers, MAX_REQS, D_INNER, D_STATE)


class MambaMixer(torch.nn.Module):
    def __init__(self, layer_id: int, pool_ref):
        super().__init__()
        self.layer_id = layer_id
        self._pool = pool_ref  # a callable: the model's pool, looked up at run time
        self.A = torch.nn.Parameter(-torch.rand(D_INNER, D_STATE), requires_grad=False)

    def forward(self, x):  # one decode step for requests 0..B-1
        pool = self._pool()
        b = x.shape[0]
        conv = pool.conv_state[self.layer_id, :b]
        ssm = pool.ssm_state[self.layer_id, :b]
        conv.copy_(torch.cat([conv[..., 1:], x.unsqueeze(-1)], dim=-1))  # shift in x
        h = conv.mean(-1)
        ssm.mul_(torch.exp(self.A)).add_(h.unsqueeze(-1))
        return x + ssm.sum(-1)


class HybridModel(CaseModel):
    def __init__(self, in_saver_region: bool, n_layers: int = 2):
        super().__init__()
        self.n_layers = n_layers
        self.req_to_token_pool = torch.nn.Module()
        self.req_to_token_pool.mamba_pool = MambaPool(n_layers, in_saver_region)
        pool = self.req_to_token_pool
        self.layers = torch.nn.ModuleList(MambaMixer(i, lambda: pool.mamba_pool)
                                          for i in range(n_layers))


def pause_resume(model: HybridModel) -> str:
    pool = model.req_to_token_pool.mamba_pool
    pool.pause()
    pool.resume(model.n_layers)
    return "memory-saver"


def run(variant: str, backend: str = "auto"):
    from .harness import capture_reload_diff

    model = HybridModel(in_saver_region=variant == "fixed")
    g = torch.Generator().manual_seed(5)
    inputs = [(f"bs{b}", torch.randn(b, D_INNER, generator=g)) for b in BATCH_SIZES]
    return capture_reload_diff(model, inputs, pause_resume, emulate=False)


POOL = "req_to_token_pool.mamba_pool"
CASE = Case(
    name="sglang-27140-mamba-state",
    reference="SGLang #27140",
    source="python/sglang/srt/mem_cache/memory_pool.py: MambaPool (conv_state, ssm_state)",
    rebound="`conv_state` / `ssm_state` freed and reallocated by a memory-saver "
            "pause/resume (state, not weights)",
    fix="re-capture (or keep the buffers in the saver's region, same storages)",
    reload="memory-saver",
    variants=buggy_and_fixed(
        "state buffers freed at pause, allocated again at resume",
        "state buffers kept in the saver region (same storages)",
        {f"{POOL}.conv_state": "dangling", f"{POOL}.ssm_state": "dangling"}, flip=False),
    run=run,
    note="captured without an emulated graph (a CUDA graph holds addresses, not tensors), "
         "so the freed state reads as dangling; on CUDA too, even when the allocator "
         "reuses the address",
)
