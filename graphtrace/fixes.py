"""Fix texts chosen by the stack a trace observed (imports no torch).

`graphtrace.sites.suggest_fix` picks a fix *kind* (`graphtrace.vocab.FIX_KINDS`) for each
stale-like edge; this module turns that kind into the text the report shows, from one table
keyed by (kind, stack, release range): `FIX_TEXTS`. A text names only APIs of the stack the
user runs, in the release they run (Note [fix texts]). `detect_stack` says which stack that
is; a report keeps it in `meta["stack"]`, so a saved report keeps its texts' basis.
"""

from __future__ import annotations

import re
import sys
from typing import Iterable, Mapping, NamedTuple

from graphtrace.vocab import FIXES, markdown_command

__all__ = ["STACKS", "Stack", "FixText", "FIX_TEXTS", "detect_stack", "fix_text",
           "parse_release", "neutral_text", "LEGACY_TEXTS", "markdown_table"]

# Note [fix texts]
# ~~~~~~~~~~~~~~~~
# A fix names a function the user can call: vLLM's `replace_parameter(..., prefer_copy=True)`
# exists in 0.21-0.32 only (0.33 dropped the keyword: replace_parameter always keeps the
# Parameter object and copies into it when shape, stride, dtype and device match); 0.34 adds
# `refill_derived` (vllm.model_executor.utils: a plain attribute derived from the weights,
# refilled in place) and `FusedMoEExperts.keep_constants`, and a direct reload mode
# (VLLM_RELOAD_MODE=direct). A plain PyTorch or transformers user has none of these. So a
# text is chosen by (kind, stack, release): the first row of FIX_TEXTS whose kind and stack
# match and whose [since, until) range holds the release; no row (another kind, an unknown
# stack, a release no row covers or none known) -> the neutral text of vocab.FIXES, which
# names torch alone. The stack is decided once per diff (`detect_stack`) from the watched
# models' classes (`__module__`: `vllm.`, `sglang.`, `transformers.`) and, failing that,
# from the engine packages imported in this process (`sys.modules`); its release from the
# imported package's `__version__`. An older report without `meta["stack"]` shows the
# neutral text in place of the one text of earlier releases that named a vLLM API
# (LEGACY_TEXTS, applied when a report is loaded).

#: stacks a trace can observe; "pytorch": none of the others
STACKS = ("pytorch", "transformers", "vllm", "sglang")


class Stack(NamedTuple):
    """The stack a trace observed: its name (one of STACKS), its release ("" if unknown)
    and what told (`"model classes"`, `"imported"`, `"none"`)."""

    name: str
    release: str = ""
    source: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "release": self.release, "source": self.source}

    @classmethod
    def from_json(cls, data: object) -> "Stack | None":
        """The Stack of a report's `meta["stack"]`; None for a missing or malformed one."""
        if not isinstance(data, Mapping) or data.get("name") not in STACKS:
            return None
        release = data.get("release") or ""
        return cls(data["name"], release if isinstance(release, str) else "",
                   str(data.get("source") or ""))


class FixText(NamedTuple):
    """One row of the table: the text of fix `kind` on `stacks` for releases in
    [since, until) (None: unbounded)."""

    kind: str
    stacks: tuple[str, ...]
    since: tuple[int, ...] | None
    until: tuple[int, ...] | None
    text: str


_TORCH = ("pytorch", "transformers")
FIX_TEXTS: tuple[FixText, ...] = (
    # -- plain PyTorch and transformers: load_state_dict, copy_, swap_tensors --------------
    FixText("copy-in-place", _TORCH, None, None,
            "load the new weights into the registered tensors' storage: "
            "load_state_dict(state_dict) without assign=True (it copies into them), or "
            "param.data.copy_(new) / tensor.copy_(new) under torch.no_grad(); not "
            "load_state_dict(..., assign=True) or torch.utils.swap_tensors, which put new "
            "storages under the same names while the graphs read the old ones"),
    FixText("register-or-copy", _TORCH, None, None,
            "register the tensor as a parameter or buffer (register_buffer) so that "
            "load_state_dict without assign=True copies into it, or copy_ the new values "
            "into the old tensor instead of rebinding the attribute"),
    # -- vLLM, by release ------------------------------------------------------------------
    FixText("copy-in-place", ("vllm",), (0, 21), (0, 33),
            "copy the new values into the registered tensor's storage "
            "(replace_parameter(layer, name, new, prefer_copy=True) in "
            "process_weights_after_loading) instead of registering a new one"),
    FixText("copy-in-place", ("vllm",), (0, 33), (0, 34),
            "keep the registered Parameter and copy into it: replace_parameter(layer, name, "
            "new) does so when shape, stride, dtype and device match (else it rebinds "
            ".data: keep them equal), or param.data.copy_(new); never register a new "
            "Parameter in process_weights_after_loading"),
    FixText("copy-in-place", ("vllm",), (0, 34), None,
            "keep the registered Parameter and copy into it (replace_parameter(layer, name, "
            "new) with equal shape, stride, dtype and device, or param.data.copy_(new)); "
            "with VLLM_RELOAD_MODE=direct the reload re-lays new data into the old storages, "
            "so process_weights_after_loading must keep addresses and lay each tensor out "
            "again as at capture (same dtype, shape, stride and offset)"),
    FixText("register-or-copy", ("vllm",), (0, 34), None,
            "refill the attribute in place with refill_derived(obj, name, new) "
            "(vllm.model_executor.utils) or, for an experts object, "
            "FusedMoEExperts.keep_constants, instead of rebinding it"),
    FixText("recompute-in-place", ("vllm",), (0, 21), (0, 34),
            "recompute the derived tensor from its updated sources into its own storage "
            "(copy_) in process_weights_after_loading, after every weight update, or compute "
            "it inside the captured forward"),
    FixText("recompute-in-place", ("vllm",), (0, 34), None,
            "recompute the derived tensor into its own storage after every weight update: "
            "refill_derived(obj, name, new) (vllm.model_executor.utils), or "
            "FusedMoEExperts.keep_constants for an experts object's tensors"),
    # -- SGLang ----------------------------------------------------------------------------
    FixText("copy-in-place", ("sglang",), None, None,
            "copy the new values into the registered tensor (SGLang's weight loaders write "
            "param.data.copy_(loaded_weight)); keep that storage: do not register a new "
            "parameter or rebind .data after loading"),
    FixText("recompute-in-place", ("sglang",), None, None,
            "recompute the derived cache from its updated sources into its own storage "
            "(copy_) after every weight update (update_weights_from_disk / "
            "update_weights_from_tensor), or compute it inside the captured forward"),
)

#: texts earlier graphtrace releases wrote into `fix` that name another stack's API, by kind:
#: a report without `meta["stack"]` shows the neutral text instead
LEGACY_TEXTS: dict[str, str] = {
    "copy the new values into the registered tensor's storage (replace_parameter(..., "
    "prefer_copy=True)) instead of registering a new one": "copy-in-place",
}

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_release(release: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of a release text ("0.34.0", "0.33.1+cpu", "0.32.0rc1"); None
    when it is not one."""
    if not isinstance(release, str):
        return None
    m = _RELEASE.match(release)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups(default="0"))


def neutral_text(kind: str) -> str:
    """The text of fix `kind` that names no stack's API (vocab.FIXES)."""
    return FIXES[kind]


def fix_text(kind: str, stack: "Stack | str | None" = None) -> str:
    """The text of fix `kind` (a vocab.FIX_KINDS word; "" gives "") for `stack` (a Stack, a
    stack name, or None: neutral), chosen as Note [fix texts] says."""
    if not kind:
        return ""
    if kind not in FIXES:
        raise ValueError(f"unknown fix kind {kind!r} (kinds are {', '.join(FIXES)})")
    if isinstance(stack, str):
        stack = Stack(stack)
    if stack is None:
        return FIXES[kind]
    release = parse_release(stack.release)
    for row in FIX_TEXTS:
        if row.kind != kind or stack.name not in row.stacks:
            continue
        if row.since is None and row.until is None:
            return row.text
        if release is None:
            continue
        if (row.since is None or release >= row.since) and \
                (row.until is None or release < row.until):
            return row.text
    return FIXES[kind]


# -- which stack (Note [fix texts]) ----------------------------------------------------------

_PACKAGES = (("vllm", "vllm"), ("sglang", "sglang"), ("transformers", "transformers"))
# what only a running engine imports (not the package alone, which a test may import)
_ENGINE_MODULES = (("vllm", "vllm.model_executor"), ("sglang", "sglang.srt"))


def _release(package: str) -> str:
    module = sys.modules.get(package)
    version = getattr(module, "__version__", "") if module is not None else ""
    return version if isinstance(version, str) else ""


def detect_stack(models: Iterable[object] = ()) -> Stack:
    """The stack of the watched `models` (nn.Modules): vLLM, SGLang or transformers when a
    module class of theirs is one of that library's (in that order), else the engine
    imported in this process (vLLM's or SGLang's model executor), else plain PyTorch."""
    found: set[str] = set()
    for model in models:
        try:  # a model whose walk raises says nothing (fail open: the diff goes on)
            tops = {type(m).__module__.partition(".")[0] for m in model.modules()}
        except Exception:
            continue
        found |= tops & {"vllm", "sglang", "transformers"}
    for name, package in _PACKAGES:
        if name in found:
            return Stack(name, _release(package), "model classes")
    for name, module in _ENGINE_MODULES:
        if module in sys.modules:
            return Stack(name, _release(name), "imported")
    return Stack("pytorch", _release("torch"), "none")


def markdown_table() -> str:
    """FIX_TEXTS as the markdown table docs/provenance.md holds verbatim (tests/test_fix_texts.py
    checks it)."""
    def bound(v):
        return ".".join(map(str, v)) if v else ""

    out = ["| fix | stacks | releases | text |", "|---|---|---|---|"]
    for r in FIX_TEXTS:
        since, until = bound(r.since), bound(r.until)
        releases = "any" if not (since or until) else \
            f"{since or '?'}+" if not until else f"{since or '?'} to before {until}"
        out.append(f"| `{r.kind}` | {', '.join(r.stacks)} | {releases} | {r.text} |")
    out.append("| any other (kind, stack, release) | | | the neutral text of `vocab.FIXES` |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    markdown_command("graphtrace.fixes", "fix texts per stack",
                     "the markdown table of docs/provenance.md", markdown_table)
