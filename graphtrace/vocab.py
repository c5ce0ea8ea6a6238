"""The words and shapes of a report, in one place (imports no torch).

Every list of verdicts, statuses, impacts, access kinds and frame columns in graphtrace is
read from here, and so are the tables in docs/internals.md (a test compares them).
The rule that gives each edge its verdict is graphtrace.verdict's (the verdict engine).
"""

from __future__ import annotations

from typing import Callable

__all__ = [
    "VERDICTS", "STALE_VERDICTS", "IMPACTS", "ORIGINS", "OWNER_STATUSES", "OWNER_KINDS",
    "ACCESS_KINDS", "EDGE_ACCESSES", "FRAMES", "SCHEMA", "COLUMNS", "COLUMN_KINDS",
    "HOLDS", "MOVED", "ORPHANED", "BEFORE_TRACE", "NOT_RECORDED",
    "PROVENANCE_MARKS", "FIXES", "FIX_KINDS", "GUARD_PROBLEMS", "GUARD_SCHEMA", "GUARD_COLUMNS",
    "GUARD_UNCHECKED",
    "GUARD_IDENTITIES", "BLIND_SPOT_KINDS", "BLIND_SPOT_FIELDS", "FINDING_KINDS",
    "FINDING_FIELDS", "ADDED_COLUMNS",
]

# -- verdicts (one per edge; the words are part of the public contract) ---------------------
VERDICTS = ("stable", "stale", "dangling", "diverged", "orphaned", "unowned", "unrefreshed")
# `unrefreshed`: Note [freshness] in graphtrace/verdict.py
STALE_VERDICTS = ("stale", "dangling", "diverged", "unrefreshed")   # what `report.stale` holds
IMPACTS = ("manifest", "latent", "unknown")           # stale-like edges: do values differ now?
ORIGINS = ("external", "internal")                    # overwritten in the graph before it reads it?

# -- owners ----------------------------------------------------------------------------------
HOLDS, MOVED, ORPHANED = "holds", "moved", "orphaned"
OWNER_STATUSES = (HOLDS, MOVED, ORPHANED)             # a capture-time owner on the live model
OWNER_KINDS = ("parameter", "buffer", "attribute")

# -- accesses --------------------------------------------------------------------------------
ACCESS_KINDS = ("read", "write", "view", "factory")   # per recorded tensor (encoding.READ..: indices)
EDGE_ACCESSES = ("read", "read+write", "write")       # per (graph, storage) edge

# -- provenance (Note [provenance] in graphtrace/provenance.py) ------------------------------
# `created_at` / `live_created_at` hold a site (graphtrace.sites grammar), "" when the column
# does not apply to the edge, or one of these marks: never a guess.
BEFORE_TRACE = "before trace"   # the storage was alive when the trace opened (a watched model's)
NOT_RECORDED = "not recorded"   # made while the trace was open where provenance could not see it
PROVENANCE_MARKS = (BEFORE_TRACE, NOT_RECORDED)
# `fix`: the suggested fix of a stale-like edge, chosen from its moved holders and verdict
# (graphtrace.sites.suggest_fix); the column holds the text. These are the neutral texts,
# naming torch alone; graphtrace.fixes picks a stack's own text where it has one.
FIXES: dict[str, str] = {
    "read-through-layer": "register it on the layer and read it through the layer at apply "
                          "time (not bound into a partial or closure), refreshed in place "
                          "on reload",
    "copy-in-place": "copy the new values into the registered tensor's storage (copy_) "
                     "instead of registering a new tensor under its name",
    "register-or-copy": "register the attribute as a parameter or buffer, or copy_ the new "
                        "values into the old tensor instead of rebinding it",
    "recapture": "the captured storage was freed: re-capture the graphs after the update, "
                 "or keep the allocation and copy_ into it",
    "recompute-in-place": "recompute the derived tensor from its updated sources into its "
                          "own storage (copy_) after every weight update, or compute it "
                          "inside the captured forward",
}
FIX_KINDS = tuple(FIXES)

# -- blind spots (graphtrace.blindspots.BlindSpot; one record per thing the recording could
# not see, in `report.blind_spots` and the report's meta) ----------------------------------
BLIND_SPOT_KINDS = (
    "opaque handle",            # an op reads an object (ScriptObject, pointer-valued tensor)
    "packed copy",              # a registered weight whose GEMM reads a packed copy instead
    "packed copy not rebuilt",  # the source of a packed copy changed, the copy did not
    "empty parameter",          # an empty parameter: its data lives where the walk did not look
    "forward context",          # an op fetches tensors by name inside itself (vLLM KV cache)
    "compiled",                 # compiled code read tensors off the dispatcher
    "walk cut",                 # the owner walk stopped (depth, size)
    "nested capture",           # a CUDA graph captured inside a capture region
    "dtype/shape change",       # the owner's live tensor has another dtype or shape
    "lineage",                  # lineage could not follow (its edge cap was hit)
    "tensor subclass",          # a subclass that dispatches its own ops but cannot be flattened
    "baked scalar",             # a Python float a graph was captured with, held by an attribute
    "other",                    # anything else (a plain text from an older report)
)
BLIND_SPOT_FIELDS = ("kind", "text", "holder", "op", "model", "graph")  # meta / frame columns

# -- findings (lineage's records beside the edges: Report.findings, Trace.findings) ---------
FINDING_KINDS = (
    "dangling source",          # a live handle whose source was freed, kept elsewhere by the model
    "released source",          # ... whose source the model dropped on purpose (consumed)
    "non-idempotent step",      # a registered storage updated in place from its own value
    "carried-over state",       # a process step read state kept from an earlier load cycle
)
FINDING_FIELDS = ("kind", "holder", "op", "source", "source_kind", "site", "n")

# -- frames ----------------------------------------------------------------------------------
# Column kinds: "int" int64 (no NA); "Int" nullable Int64; "bool" (no NA); "str" ("" when
# unknown, never NA); "str?" (NA allowed, "" means NA); extra columns may also be "float"
# and "boolean".
COLUMN_KINDS = ("int", "Int", "bool", "boolean", "float", "str", "str?")
FRAMES = ("accesses", "storages", "owners", "edges")
SCHEMA: dict[str, tuple[tuple[str, str], ...]] = {
    "accesses": (
        ("graph_id", "int"), ("graph", "str"), ("seq", "int"), ("op", "str"),
        ("module", "str"), ("arg", "str"), ("access", "str"), ("storage_id", "int"),
        ("data_ptr", "int"), ("dtype", "str"), ("shape", "str"), ("stride", "str"),
        ("offset", "int"), ("device", "str"),
    ),
    "storages": (
        ("storage_id", "int"), ("data_ptr", "int"), ("nbytes", "int"), ("device", "str"),
        ("alive", "bool"), ("first_access", "str"),
    ),
    "owners": (
        ("storage_id", "int"), ("model", "str"), ("path", "str"), ("kind", "str"),
        ("status", "str"), ("live_data_ptr", "Int"),
    ),
    "edges": (
        ("graph_id", "int"), ("graph", "str"), ("storage_id", "int"), ("access", "str"),
        ("ops", "str"), ("args", "str"), ("module", "str"), ("data_ptr", "int"),
        ("nbytes", "int"), ("dtype", "str"), ("shape", "str"), ("owners", "str"),
        ("owner_kinds", "str"), ("n_owners", "int"), ("live_data_ptr", "Int"),
        ("verdict", "str"), ("impact", "str?"), ("origin", "str?"),
        ("created_at", "str"), ("live_created_at", "str"), ("fix", "str"),
        ("derived_from", "str"),
    ),
}
# Columns added to a frame after format 1, with the value an older report's rows get when
# it is read (graphtrace.report fills them in): older reports still load.
ADDED_COLUMNS: dict[str, dict[str, str]] = {"edges": {"derived_from": ""}}
COLUMNS: dict[str, list[str]] = {name: [c for c, _ in cols] for name, cols in SCHEMA.items()}

# -- guard (graphtrace.guard: `guard.check()`, one row per problem edge) -------------------
GUARD_PROBLEMS = ("stale", "dangling", "diverged", "orphaned", "unrefreshed")  # a guard fails on
GUARD_IDENTITIES = ("storage", "data_ptr")  # live weak handle, or address + size (from JSON)
GUARD_SCHEMA: tuple[tuple[str, str], ...] = (
    ("graph_id", "int"), ("graph", "str"), ("storage_id", "int"), ("data_ptr", "int"),
    ("nbytes", "int"), ("dtype", "str"), ("shape", "str"), ("owners", "str"),
    ("owner_kinds", "str"), ("statuses", "str"), ("live_data_ptr", "Int"), ("verdict", "str"),
    ("impact", "str?"), ("identity", "str"), ("derived_from", "str"),
    # a blind spot's row (Note [blind spots in the guard]): its kind and text; "" on edge
    # rows, but for a stale edge's re-laid owner `note` names both views (Note [re-laid views])
    ("blind_spot", "str"), ("note", "str"),
)
# the verdict of a blind spot's guard row (Note [blind spots in the guard])
GUARD_UNCHECKED = "unchecked"
GUARD_COLUMNS: list[str] = [c for c, _ in GUARD_SCHEMA]


# -- docs ------------------------------------------------------------------------------------
WORD_LISTS = ("VERDICTS", "STALE_VERDICTS", "IMPACTS", "ORIGINS", "OWNER_STATUSES",
              "OWNER_KINDS", "ACCESS_KINDS", "EDGE_ACCESSES", "COLUMN_KINDS",
              "PROVENANCE_MARKS", "FIX_KINDS", "BLIND_SPOT_KINDS")


def markdown_tables() -> str:
    """The word lists above and each frame's columns as markdown tables: the text that
    docs/internals.md holds verbatim (tests/test_docs.py checks it), so the docs never list
    a word this module does not."""
    g = globals()
    out = ["| list | words |", "|---|---|"]
    out += [f"| `{name}` | {', '.join(f'`{w}`' for w in g[name])} |" for name in WORD_LISTS]
    out += ["", "| frame | columns (kind) |", "|---|---|"]
    out += [f"| `{frame}` | {', '.join(f'`{c}` {k}' for c, k in SCHEMA[frame])} |"
            for frame in FRAMES]
    out += ["", "| fix | text |", "|---|---|"]
    out += [f"| `{kind}` | {text} |" for kind, text in FIXES.items()]
    return "\n".join(out) + "\n"


def markdown_command(module: str, what: str, where: str, table: Callable[[], str]) -> None:
    """`python -m <module> --markdown`: print `table()`, the markdown `where` holds verbatim
    (the command line of this module and of graphtrace.fixes)."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m {module}",
                                 description=f"Print graphtrace's {what}.")
    ap.add_argument("--markdown", action="store_true", required=True, help=f"as {where}")
    ap.parse_args()
    print(table(), end="")


if __name__ == "__main__":
    markdown_command("graphtrace.vocab", "vocabulary", "the markdown tables of docs/internals.md",
                     markdown_tables)
