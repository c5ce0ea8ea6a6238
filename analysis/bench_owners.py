"""Owner walk on a 10,000-module model: how long a snapshot and a re-resolve take.

Model: a ModuleList of 2,500 blocks (block + up Linear + down Linear + LayerNorm = 4 modules
each, 10,002 with the list and the root). Each down projection holds a kernel-like plain
object, as vLLM's quant methods do: a `functools.partial` with a tensor keyword, a lambda
closing over a tensor, a bound method, a dict of tensors and a config dataclass.

    python analysis/bench_owners.py [--blocks 2500] [--repeat 5]
"""

from __future__ import annotations

import argparse
import collections
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from _common import best_of
from graphtrace.owners import resolve_path, walk_owners


@dataclass
class KernelConfig:
    group_size: int = 128
    act_order: bool = True
    sizes: list[int] = field(default_factory=lambda: [4, 4])


class Kernel:
    def __init__(self, layer: nn.Linear, perm: torch.Tensor):
        self.config = KernelConfig()
        self.act_perm = functools.partial(torch.index_select, dim=1, index=perm)
        self.gather = lambda x: x[:, perm]
        self.scales = {"group": torch.ones(1), "channel": torch.ones(1)}
        self.apply = self.apply_weights  # bound method of the kernel itself
        self.layer_ref = layer  # a module as a plain attribute: not walked again

    def apply_weights(self, x):
        return self.gather(x)


class QuantMethod:
    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.name = "machete"


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.down.quant_method = QuantMethod(Kernel(self.down, torch.arange(d)))


def build(blocks: int, d: int = 4) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(Block(d) for _ in range(blocks))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2500)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    model = build(args.blocks)
    n_modules = sum(1 for _ in model.named_modules())
    print(f"torch {torch.__version__}; {n_modules} modules "
          f"({args.blocks} blocks); best of {args.repeat}")

    t_mods, _ = best_of(lambda: list(model.named_modules(remove_duplicate=False)), args.repeat)
    t_regs, _ = best_of(lambda: (list(model.named_parameters(remove_duplicate=False)),
                              list(model.named_buffers(remove_duplicate=False))), args.repeat)
    t_walk, owners = best_of(lambda: list(walk_owners(model)), args.repeat)
    kinds = collections.Counter(k for _, k, _ in owners)
    paths = [p for p, _, _ in owners]
    t_res, resolved = best_of(lambda: [resolve_path(model, p) for p in paths], args.repeat)
    assert all(r is t for r, (_, _, t) in zip(resolved, owners)), "round trip failed"

    print(f"owners: {len(owners)} ({', '.join(f'{k} {n}' for k, n in kinds.items())})")
    print(f"example: {next(p for p in paths if 'keywords' in p)}")
    print(f"named_modules alone:            {t_mods * 1e3:8.1f} ms")
    print(f"named_parameters + buffers:     {t_regs * 1e3:8.1f} ms")
    print(f"walk_owners (all owners):       {t_walk * 1e3:8.1f} ms  "
          f"= {t_walk / n_modules * 1e6:.2f} us/module")
    print(f"resolve_path, every owner path: {t_res * 1e3:8.1f} ms  "
          f"= {t_res / len(paths) * 1e6:.2f} us/path")


if __name__ == "__main__":
    main()
