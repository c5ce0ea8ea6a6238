"""Python scalars baked into captured graphs (issue 25, part 4).

Note [baked scalars]
~~~~~~~~~~~~~~~~~~~~
A Python number an op is given (`x * self.scaling["default"]`, a LoRA scaling kept as a
float) is not a tensor: a CUDA graph (and an emulated one) replays the value it was captured
with, whatever the attribute says after an update. After each emulated capture the floats
its kept ops were given are matched against the float attributes of the watched models at
that moment (`graphtrace.owners.scalar_owners`: module attributes, and dict entries under
them). A value that equals exactly one holder is recorded with that holder's path; one that
equals several is recorded with all of them, and called ambiguous rather than guessed.
`check(models)` (the diff) names each holder whose value changed since capture as a `baked
scalar` blind spot (the graph keeps the old constant); the guard checks the same holders
(Note [blind spots in the guard]). Only floats (ints are sizes and indices, too many to
match), only emulated captures (a real CUDA graph's arguments are not kept), and not inside
compiled code (Dynamo turns a float attribute into a graph input or a constant of its own).
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from graphtrace._schema import op_name
from graphtrace.blindspots import BlindSpot
from graphtrace.owners import resolve_value, scalar_owners

__all__ = ["BakedScalars", "floats_in"]


def floats_in(value: object, out: list, depth: int = 0) -> None:
    """The Python floats in an op argument (plain, or in a list or tuple)."""
    if type(value) is float:
        out.append(value)
    elif type(value) in (list, tuple) and depth < 2:
        for v in value:
            floats_in(v, out, depth + 1)


class BakedScalars:
    """The floats each emulated capture baked in that a watched model's attribute held."""

    def __init__(self):
        # (graph label, op, value, ((model, path), ...)) per baked float, once per graph
        self.records: list[tuple[str, str, float, tuple]] = []

    def note_found(self, label: str, floats: Mapping[float, object],
                   models: Mapping[str, nn.Module], native=None) -> None:
        """Match the floats an emulated graph found as it kept its ops (float -> the first op
        taking it: EmulatedGraph.baked_floats). `native`: graphtrace.native's module, which
        reads the models' attributes in C++ (owners.scalar_owners)."""
        if not floats:
            return
        found: dict[float, str] = {}
        for v, func in floats.items():
            try:
                found[v] = op_name(func)
            except Exception:
                found[v] = str(func)
        holders: dict[float, list] = {}
        for name, model in models.items():
            for path, value in scalar_owners(model, found, native):
                if value in found:
                    holders.setdefault(value, []).append((name, path))
        for value, held in holders.items():
            self.records.append((label, found[value], value, tuple(sorted(held))))

    def check(self, models: Mapping[str, nn.Module]) -> list[BlindSpot]:
        """A `baked scalar` record per holder whose value changed since its capture."""
        out = []
        for label, op, value, held in self.records:
            changed = []
            for name, path in held:
                model = models.get(name)
                now = resolve_value(model, path) if model is not None else None
                if now != value:
                    changed.append((name, path, now))
            if not changed:
                continue
            names = ", ".join(p for _, p in held)
            what = "; ".join(f"{p} is now {now!r}" for _, p, now in changed)
            ambiguous = (f" (ambiguous: {len(held)} attributes held {value!r} at capture: "
                         f"{names}; which one the graph used is not known)" if len(held) > 1
                         else "")
            for name, path, _ in changed:
                out.append(BlindSpot(
                    "baked scalar", f"baked scalar: graph {label!r} passes {value!r} to {op}, "
                    f"which {path} held at capture; {what}: the graph keeps the old "
                    f"constant{ambiguous}", holder=path, op=op, model=name, graph=label))
        return out

    def spots(self) -> list[BlindSpot]:
        """The records as capture-time blind spots for the guard (each holder's value is kept
        as the guard's `value`: `value_of`)."""
        return [BlindSpot("baked scalar", f"baked scalar: graph {label!r} passes {value!r} to "
                          f"{op}, held by {path}", holder=path, op=op, model=name, graph=label)
                for label, op, value, held in self.records for name, path in held]

    def value_of(self, spot: BlindSpot) -> float | None:
        for label, op, value, held in self.records:
            if label == spot.graph and op == spot.op and (spot.model, spot.holder) in held:
                return value
        return None
