"""The serving core: check before serve, for any engine (issue #40, item 2).

A `ServingCore` owns the update lifecycle of one guarded trace inside a serving engine:
an update begins (`update_begin`: the engine is *dirty*, the guard built first from the
capture-time owners) and ends (`update_end`: a whole update by itself is checked now);
in-place writes are seen by version counters (`written_in_place`, Note [in-place writes]);
one check runs per update before the next forward (`check`, `pending`), with the refusal
decision (``raise``: the `StaleGraphError` stands in `refusal` until a correct update
passes) and its record (``history``, ``checks.jsonl``); ranks agree through an injected
collective (`Ranks`; default one rank). It imports no engine.

An engine adapter (graphtrace/vllm/ for vLLM) supplies only the engine's side: where the
model and captures are (a `ServedEngine`), which entry points are updates, how a refusal
reaches its clients, and its version table (the table of docs/internals.md, "The serving core").

Note [in-place writes]
~~~~~~~~~~~~~~~~~~~~~~
A client may write the weights in place without any of the hooked entry points (its own
function, a direct ``p.copy_(new)`` on the worker's model). Each in-place op bumps the
tensor's version counter (autograd's; writes through ``p.data`` do not: ``.data`` has a
counter of its own). So before every step, a core that is not dirty compares the sum of
its watched parameters' version counters (every parameter of the trace's models, held weakly;
a freed one counts as a change) with the sum taken when the model was loaded or after its
last check (or, for a core made later, at its first step): a difference marks
the engine dirty ("in-place write") and the check runs before that step. The sum is taken
again after each check, so a hooked update that also bumps counters is checked once. The
parameters are walked (``model.parameters()``: milliseconds on an 80-layer model) when the
model is loaded and again only when a watched one was freed (an update that rebinds them,
as vLLM's reload does); a parameter rebound while the old one stays alive elsewhere is not
watched until then (its owners moving is the guard's own check). The sum
is taken in C++ (``versions_sum`` of graphtrace/csrc/recorder.cpp) when the trace records
natively, in Python otherwise. The test runs where the core is: an adapter calls `pending`
(which runs it) where the engine decides its next forward, in the core's process; workers in
processes of their own rely on the adapter marking the update pending some other way (vLLM:
Note [check before serve] in graphtrace/vllm/serve.py).
An in-place write is not itself stale (the graph reads the same storage); what it catches is
the rebinding that a client's own weight processing may do along with it.

The dirty flag is cleared only by a passing check (``raise``), or once the problems were
logged (``warn``) or re-captured away (``recapture``). So a refused engine refuses every
forward until a correct update (or a re-capture) passes. An internal error of the core
is logged and counted and the engine serves (fail open), unless ``GRAPHTRACE_STRICT=1``.

Note [recapture that cannot help]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``recapture`` the engine is asked to record its graphs again. Where it cannot, or
where graphtrace's re-recording would not rebuild what the engine replays (SGLang's compiled
CPU graphs: Inductor froze the weights into the compiled code, and re-running an eager dummy
forward would pass the guard while decode keeps the old constants), a re-capture claimed
would be a false all-clear. So the engine says why not (`ServedEngine.cannot_recapture`, or
`recapture` answering False), and the check then acts as under ``raise``: the problems
stand, the engine stays dirty, the refusal's text starts with that reason. With several
ranks, one rank that cannot makes every rank act so (they agree first).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Protocol

logger = logging.getLogger("graphtrace.serving")

__all__ = ["ServingCore", "ServedEngine", "Ranks", "single_rank", "pending", "strict",
           "ACTIONS", "STRICT_ENV"]

ACTIONS = ("raise", "warn", "recapture")
STRICT_ENV = "GRAPHTRACE_STRICT"

_cores: "weakref.WeakSet[ServingCore]" = weakref.WeakSet()
_lock = threading.RLock()  # the set of cores


def strict() -> bool:
    """``GRAPHTRACE_STRICT=1``: internal errors raise (tests) instead of failing open."""
    return os.environ.get(STRICT_ENV) == "1"


class Ranks(NamedTuple):
    """The ranks of one engine that check together: this one's place and an all-gather."""

    rank: int                          # this rank's index in the group
    size: int                          # the group's size (> 1)
    gather: Callable[[Any], list]      # every rank's value, in rank order (every rank calls it)


def single_rank() -> Ranks | None:
    """The default collective: one rank, nothing to agree on."""
    return None


class ServedEngine(Protocol):
    """What a `ServingCore` asks of its engine adapter."""

    @property
    def trace(self):
        """The graphtrace ``Trace`` whose captures are guarded (None: it is gone). The core
        reads ``captures``, ``models``, ``native`` and calls ``guard(first_graph=, accept=)``
        and ``models_changed()``."""

    def rank(self) -> int:
        """This worker's rank, for the records."""

    def recapture(self, captures: list) -> bool:
        """``recapture``: record the graphs of ``captures`` again on the updated model
        (appended to the trace's captures); False when the engine cannot (Note [recapture
        that cannot help]). Only asked under ``recapture``."""

    def cannot_recapture(self, captures: list) -> str | None:
        """Optional: why re-recording ``captures`` would not rebuild what the engine replays
        (one line, naming the engine's runner), or None when it can; asked before
        `recapture`. An adapter without it is asked `recapture` directly."""


def pending() -> list["ServingCore"]:
    """The live cores of this process that must check before the next forward: dirty, or
    written in place since their last check (Note [in-place writes])."""
    return [c for c in _cores if c.dirty or c.written_quietly()] if _cores else []


class ServingCore:
    """The update state of one guarded trace (module doc).

    ``engine``: the adapter (`ServedEngine`). ``action``: ``raise``, ``warn`` or
    ``recapture``, or a callable returning one (read at each check). ``folder``: a callable
    giving where ``guard.json``, ``checks.jsonl`` and ``problems-<N>.csv`` go (None: nothing
    written, the entries are kept in ``history``). ``accept``: blind-spot kinds the guard
    accepts. ``complete``: the entry points that are a whole update by themselves (checked
    when they end). ``collective``: a callable giving the `Ranks` that agree on each check,
    or None for one rank (`single_rank`). ``every_rank_raises``: with several ranks, each
    raises the agreed error (an engine that answers with one rank's result and must refuse
    on every rank alike: SGLang); by default only the last rank does (vLLM: Note [one rank
    raises] in graphtrace/vllm/plugin.py). ``log``: where its messages go (the adapter's
    logger).
    """

    def __init__(self, engine: ServedEngine, action: str | Callable[[], str] = "raise",
                 folder: Callable[[], Path | None] | None = None, *,
                 accept: Iterable[str] = (), complete: Iterable[str] = (),
                 collective: Callable[[], Ranks | None] = single_rank,
                 every_rank_raises: bool = False, log: logging.Logger = logger):
        if isinstance(action, str) and action not in ACTIONS:
            raise ValueError(f"guard action {action!r} is not one of {', '.join(ACTIONS)}")
        self.engine = engine
        self._action = action
        self._folder = folder
        self.accept = tuple(accept)
        self.complete = frozenset(complete)
        self.collective = collective
        self.every_rank_raises = every_rank_raises
        self.log = log
        self.guard = None
        self.n_graphs = 0       # captures the guard covers
        self.first_graph = 0    # graphs captured before a recapture are gone
        self.checks = 0
        self.errors = 0
        self.dirty = False
        self.updates: list[str] = []  # the entry points that mutated weights since the last pass
        self.last: dict | None = None
        self.history: list[dict] = []
        self.refusal = None     # the StaleGraphError of the last check, while it stands
        # Note [in-place writes]: the watched parameters (weakly) and their version counters' sum
        self._watched: list | None = None
        self._versions = 0
        self._sum = None  # the native versions_sum, when the trace records natively
        self._lock = threading.RLock()  # one core's state (not the process's: two engines)
        with _lock:
            _cores.add(self)

    # -- state -----------------------------------------------------------------------------
    def action(self) -> str:
        value = self._action() if callable(self._action) else self._action
        return value if value in ACTIONS else "raise"

    def close(self) -> None:
        """Its trace ended: the engine's steps no longer consult it."""
        with _lock:
            _cores.discard(self)

    def folder(self) -> Path | None:
        return self._folder() if self._folder is not None else None

    def rank(self) -> int:
        return self.engine.rank()

    def refresh(self):
        """The guard of the graphs captured so far (rebuilt when graphs were captured since)."""
        trace = self.engine.trace
        captures = trace.captures
        if self.guard is None or len(captures) != self.n_graphs:
            if len(captures) <= self.first_graph:
                self.guard = None
            else:
                self.guard = trace.guard(first_graph=self.first_graph, accept=self.accept)
                folder = self.folder()
                if folder is not None:
                    folder.mkdir(parents=True, exist_ok=True)
                    self.guard.to_json(folder / "guard.json")
            self.n_graphs = len(captures)
        return self.guard

    # -- the update lifecycle (events an adapter's hooks fire) -----------------------------
    def update_begin(self, method: str) -> None:
        """A weight update starts (or goes on): the engine is dirty until a check passes. The
        guard is built now, from the capture-time owners, before the update moves them."""
        if self.dirty:  # the common case, once per call of a per-tensor sync: no lock
            updates = self.updates
            if not updates or updates[-1] != method:
                updates.append(method)
            return
        if self.engine.trace is None:  # the trace is gone
            return
        with self._lock:
            if not self.dirty:
                try:
                    if self.refresh() is None:
                        return  # no graph captured yet: nothing can read a stale storage
                except Exception:
                    self._failed("building the guard before " + method)
            self.dirty = True
            if not self.updates or self.updates[-1] != method:
                self.updates.append(method)

    mark = update_begin

    def update_end(self, method: str) -> dict | None:
        """A weight update's entry point returned: checked now when it is a whole update by
        itself (``complete``), else at the explicit end or before the next forward."""
        return self.check(method) if method in self.complete else None

    def before_update(self, source, method: str) -> None:
        """`update_begin` as a hook listener ``fn(source, method)``."""
        self.update_begin(method)

    def after_update(self, source, method: str) -> None:
        """`update_end` as a hook listener ``fn(source, method)``."""
        self.update_end(method)

    # -- the check ---------------------------------------------------------------------------
    def check(self, trigger: str, *, force: bool = False) -> dict:
        """Check once if dirty (or ``force``): returns the check's entry ({"ok": True,
        "checked": False} when clean); raises `StaleGraphError` under ``raise`` (`_decide`)."""
        from graphtrace.guard import empty_problems

        trace = self.engine.trace
        ranks = self.collective()
        if ranks is not None:  # the ranks agree (every rank takes part): every rank checks, or none
            if not (_any(ranks, self.dirty) or force) or trace is None:
                return {"ok": True, "checked": False}
        elif trace is None or not (self.dirty or force):
            return {"ok": True, "checked": False}
        action = self.action()
        problems, failure = empty_problems(), None
        with self._lock:
            try:
                guard = self.refresh()
                if guard is not None:
                    problems = guard.check()
            except Exception:
                failure = sys.exc_info()
                self._failed("checking the guard (" + trigger + ")")
            found = len(problems) > 0
            refused = None  # why the engine cannot re-capture (Note [recapture that cannot help])
            if action == "recapture" and (_any(ranks, found) if ranks is not None else found):
                try:  # a re-capture may be collective: all ranks re-capture
                    problems, refused = self._recapture(problems)
                except Exception as exc:
                    failure = failure or sys.exc_info()
                    refused = f"re-recording the graphs failed ({type(exc).__name__}: {exc})"
                    self._failed("re-capturing (" + trigger + ")")
                if ranks is not None and _any(ranks, refused is not None) and refused is None:
                    refused = "another rank cannot re-capture"
            entry = self._record(trigger, problems, action, refused)
            if refused is not None:
                action = "raise"  # the problems stand: refused as under raise
            try:  # graphs captured from now on: their owners from a fresh walk
                trace.models_changed()
            except Exception:
                self._failed("refreshing owners (" + trigger + ")")
            note = f"recapture is not possible: {refused}\n" if refused is not None else ""
            gathered = _gather_problems(ranks, problems, self.rank(), note) \
                if ranks is not None else None
            bad = any(len(f) for _, f, _ in gathered) if gathered is not None \
                else bool(len(problems))
            what = self._what(trigger)
            if action != "raise" or not bad:  # all ranks agree: they stay dirty together
                self.dirty = False
                self.updates = []
            elif self.every_rank_raises:  # a clean rank refuses too: it checks with the others
                self.dirty = True
        self._rebase_versions()  # writes from now on are the next update's
        self.refusal = None
        self._decide(action, problems, gathered, ranks, what, note)
        if failure is not None and strict():
            raise failure[1].with_traceback(failure[2])
        return entry

    def _decide(self, action: str, problems, gathered, ranks: Ranks | None, what: str,
                note: str = "") -> None:
        """The refusal: ``warn`` logs; ``raise`` raises `StaleGraphError` (several ranks:
        `_raise_for_all_ranks`) and keeps it in `refusal` while it stands. ``note``: a line
        put before the problems (why a re-capture could not)."""
        from graphtrace.guard import StaleGraphError, describe

        try:
            if action == "warn":
                if len(problems):
                    self.log.warning("graphtrace guard (rank %s, %s): %s", self.rank(), what,
                                   describe(problems))
            elif ranks is None:
                if len(problems):
                    raise StaleGraphError(f"graphtrace guard (rank {self.rank()}, {what}): "
                                          f"{note}{describe(problems)}", problems)
            else:
                self._raise_for_all_ranks(ranks, gathered, problems, what)
        except StaleGraphError as exc:
            self.refusal = exc  # what a client in another process asks for (refusal_info)
            raise

    def refusal_info(self) -> dict | None:
        """The standing refusal as plain data (it crosses an engine's RPC): message,
        problems' rows and columns; None when the last check refused nothing."""
        exc = self.refusal
        if exc is None or not self.dirty:
            return None
        import json

        problems = exc.problems
        return {"message": str(exc), "columns": list(problems.columns),
                "rows": json.loads(problems.to_json(orient="values", default_handler=str))}

    def status(self) -> dict:
        return {"pid": os.getpid(), "action": self.action(), "dirty": self.dirty,
                "updates": list(self.updates), "checks": self.checks, "errors": self.errors,
                "storages": len(self.guard) if self.guard is not None else 0,
                "watched": len(self._watched or ()), "last": self.last,
                "folder": str(self.folder() or "")}

    # -- in-place writes (Note [in-place writes]) ---------------------------------------------
    def watch_versions(self) -> None:
        """Take the watched parameters (those of the trace's models, weakly) and the sum of
        their version counters: the baseline `written_in_place` compares with."""
        try:
            trace = self.engine.trace
            watched, total, seen = [], 0, set()
            for model in (trace.models.values() if trace is not None else ()):
                for p in model.parameters():
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    try:
                        version = p._version  # inference tensors have no version counter
                    except RuntimeError:
                        continue
                    watched.append(weakref.ref(p))
                    total += version
            self._watched, self._versions = watched, total
            native = getattr(trace, "native", None) if trace is not None else None
            self._sum = getattr(native, "versions_sum", None)
        except Exception:
            self._watched = []
            self._failed("taking the parameters' version counters")

    def written_in_place(self) -> bool:
        """Was a watched parameter written in place (its version counter moved) or freed
        since `watch_versions`? Then the engine is marked dirty (once per such write)."""
        watched = self._watched
        if watched is None:  # the first step: the baseline
            self.watch_versions()
            return False
        if self._total(watched) == self._versions:
            return False
        self.update_begin("in-place write")
        self._rebase_versions()  # one mark per write, even while no graph is captured
        return True

    def written_quietly(self) -> bool:
        """`written_in_place`, failing open: an error is counted, not raised (unless strict)."""
        try:
            return self.written_in_place()
        except Exception:
            if strict():
                raise
            self._failed("comparing version counters")
            return False

    def _total(self, watched: list) -> int:
        """The sum of the watched parameters' version counters; -1 when one was freed."""
        total = self._sum(watched) if self._sum is not None else None
        if total is None:
            total = 0
            for ref in watched:
                p = ref()
                if p is None:
                    return -1
                total += p._version
        return total

    def _rebase_versions(self) -> None:
        """A new baseline: the sum again (microseconds), or a walk when a parameter was
        freed (Note [in-place writes])."""
        watched = self._watched
        total = self._total(watched) if watched else -1
        if total < 0:
            self.watch_versions()
        else:
            self._versions = total

    def _raise_for_all_ranks(self, ranks: Ranks, gathered: list, problems, what: str) -> None:
        """Several ranks (below, "several ranks"; ``every_rank_raises``)."""
        from graphtrace.guard import StaleGraphError, describe

        bad = {r: (frame, note) for r, frame, note in gathered if len(frame)}
        if not bad:
            return
        if ranks.rank != ranks.size - 1 and not self.every_rank_raises:
            if len(problems):
                self.log.error("graphtrace guard (rank %s, %s): %s (the last rank raises for "
                               "all ranks)", self.rank(), what, describe(problems))
            return
        import pandas as pd

        text = "\n".join(f"rank {r}: {note}{describe(frame)}" for r, (frame, note) in bad.items())
        merged = pd.concat([f.assign(rank=r) for r, (f, _) in bad.items()], ignore_index=True)
        raise StaleGraphError(f"graphtrace guard ({what}), problems in rank(s) "
                              f"{', '.join(map(str, bad))} of {len(gathered)}:\n{text}", merged)

    # -- internals ---------------------------------------------------------------------------
    def _what(self, trigger: str) -> str:
        updates = ", ".join(self.updates) or "no update"
        return f"{trigger} after {updates}" if trigger not in self.updates else f"after {updates}"

    def _failed(self, where: str) -> None:
        self.errors += 1
        self.log.exception("graphtrace: guard error %s (fail open)", where)

    def _record(self, trigger: str, problems, action: str, refused: str | None = None) -> dict:
        """One entry per check: in ``history``, and a line of ``checks.jsonl`` (with the
        problems in ``problems-<N>.csv``) when the core has a folder."""
        import json

        self.checks += 1
        n = int(len(problems))
        entry = {"check": self.checks, "pid": os.getpid(), "rank": self.rank(),
                 "trigger": trigger, "updates": list(self.updates), "action": action,
                 "ok": not n, "checked": True, "n_problems": n,
                 "verdicts": sorted(set(problems["verdict"])) if n else [],
                 "owners": sorted(set(problems["owners"])) if n else [],
                 "graphs": len(self.guard.graphs) if self.guard is not None else 0,
                 "storages": len(self.guard) if self.guard is not None else 0,
                 "time": time.time()}
        if refused is not None:
            entry["recapture_refused"] = refused
        folder = self.folder()
        if folder is not None and self.guard is not None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                if n:
                    problems.to_csv(folder / f"problems-{self.checks}.csv", index=False)
                    entry["problems_csv"] = f"problems-{self.checks}.csv"
                with open(folder / "checks.jsonl", "a") as f:
                    f.write(json.dumps(entry) + "\n")
            except Exception:
                self._failed("writing the guard check (" + trigger + ")")
        self.last = entry
        self.history.append(entry)
        del self.history[:-100]
        return entry

    def _recapture(self, problems) -> tuple[Any, str | None]:
        """``recapture``: the engine records the graphs again on the updated model; the guard
        then covers the new graphs only, and is checked. Returns the problems and, where the
        engine cannot re-capture, why (the problems stand: Note [recapture that cannot
        help])."""
        trace = self.engine.trace
        captures = trace.captures
        start = len(captures)
        old = list(captures[self.first_graph:])
        ask = getattr(self.engine, "cannot_recapture", None)
        why = ask(old) if ask is not None else None
        if why is not None:
            return problems, why
        if not self.engine.recapture(old):
            return problems, "the engine could not record its graphs again"
        self.first_graph = start
        self.guard = None
        guard = self.refresh()
        if guard is None:
            self.log.warning("graphtrace: recapture: no graph could be re-recorded; nothing to guard")
            return problems.iloc[0:0], None
        self.log.info("graphtrace: recaptured %d graph(s) after a weight update", len(guard.graphs))
        return guard.check(), None


# -- several ranks ---------------------------------------------------------------------------
# Every rank runs the same update and takes part in each check: they agree whether to check
# (any rank dirty), and on the problems; only the last rank raises, for all of them (an
# engine's RPC may read the ranks' answers in order and stop at the first error: vLLM's
# reason is Note [one rank raises] in graphtrace/vllm/plugin.py). Each rank records its own.

def _any(ranks: Ranks, flag: bool) -> bool:
    """True on every rank if it is True on any."""
    return any(ranks.gather(bool(flag)))


def _gather_problems(ranks: Ranks, problems, label: int, note: str = "") -> list:
    """[(rank label, problems, note)] of every rank."""
    import pandas as pd

    mine = (label, problems.to_dict("records"), list(problems.columns), note)
    return [(r, pd.DataFrame(rows, columns=columns), n)
            for r, rows, columns, n in ranks.gather(mine)]
