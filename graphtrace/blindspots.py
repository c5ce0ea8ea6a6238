"""One record per thing a recording could not see: `BlindSpot` (imports no torch).

A trace collects them (`Trace.add_blind_spot`), the diff adds its own, the report keeps
them in ``meta["blind_spots"]`` as JSON objects (`BlindSpot.to_json`) and gives them back as
texts (`Report.blind_spots`), records (`Report.blind_spot_records`) or a frame
(`Report.blind_spots_frame`). A record names what it is about so that it can be matched
to the edges it concerns (`BlindSpot.matches`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from graphtrace.vocab import BLIND_SPOT_FIELDS, BLIND_SPOT_KINDS

__all__ = ["BlindSpot"]


@dataclass(frozen=True)
class BlindSpot:
    """What the recording could not see: `kind` (vocab.BLIND_SPOT_KINDS), a sentence
    (`text`), the owner path it is about (`holder`, "" when none), the op (`op`), the
    watched model's name (`model`) and the graph label it applies to (`graph`, "": all)."""

    kind: str
    text: str
    holder: str = ""
    op: str = ""
    model: str = ""
    graph: str = ""

    def __post_init__(self):
        if self.kind not in BLIND_SPOT_KINDS:
            raise ValueError(f"unknown blind spot kind {self.kind!r} (kinds: "
                             f"{', '.join(BLIND_SPOT_KINDS)})")
        for name in BLIND_SPOT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"BlindSpot.{name} must be a str, got {type(value).__name__}")

    def to_json(self) -> dict[str, str]:
        """The record as it is kept in a report's meta."""
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> "BlindSpot":
        """A record from a report's meta: an object with the fields above, or a plain string
        (older reports: kind ``other``). ValueError/TypeError for anything else."""
        if isinstance(value, BlindSpot):
            return value
        if isinstance(value, str):
            return cls("other", value)
        if not isinstance(value, dict):
            raise TypeError(f"a blind spot is a string or an object, got {type(value).__name__}")
        unknown = set(value) - set(BLIND_SPOT_FIELDS) - {"message"}
        if unknown:
            raise ValueError(f"unknown blind spot field {sorted(unknown)[0]!r} (fields: "
                             f"{', '.join(BLIND_SPOT_FIELDS)})")
        fields = {k: value[k] for k in BLIND_SPOT_FIELDS if k in value}
        fields.setdefault("kind", "other")
        if "text" not in fields:  # an early per-graph form: {"graph": ..., "message": ...}
            fields["text"] = value.get("message", "")
        if "graph" in fields and isinstance(fields["graph"], int) \
                and not isinstance(fields["graph"], bool):
            fields["graph"] = str(fields["graph"])
        return cls(**fields)

    def matches(self, owners: str, ops: str) -> bool:
        """Does this record concern an edge with these ``owners`` ("; "-joined paths) and
        ``ops`` (";"-joined op names)? Its holder is one of the owners or its op one of
        the ops."""
        return bool((self.holder and self.holder in owners.split("; "))
                    or (self.op and self.op in ops.split(";")))

    def __str__(self) -> str:
        return self.text
