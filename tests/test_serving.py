"""`graphtrace.serving`: the serving core driven by a made-up engine, no vLLM (issue #40).

`Server` is a thin adapter of an engine shaped like SGLang's: ``begin_weight_update`` ..
``end_weight_update`` is one update, ``update_weights_from_disk`` a whole one, releasing and
resuming memory occupation marks the weights changed, and a refusal reaches its client as
``success=False`` with the message. It supplies only what the core asks (`ServedEngine`):
where the trace is, its rank, and which entry points are updates; the core does the rest.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.serving import Ranks, ServingCore, pending


class Kernel:
    """What a quantization method keeps: a scale its weight processing recomputes."""

    def __init__(self):
        self.scale = torch.ones(4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.kernel = Kernel()

    def forward(self, x):
        return self.proj(x) * self.kernel.scale


class Adapter:
    """The engine side the core asks for (graphtrace.serving.ServedEngine)."""

    def __init__(self, trace, rank: int = 0):
        self.trace, self._rank, self.recaptured = trace, rank, []

    def rank(self) -> int:
        return self._rank

    def recapture(self, captures: list) -> bool:
        self.recaptured.append([c.label for c in captures])
        return False  # this engine cannot re-capture: the problems stand


class CompiledAdapter(Adapter):
    """An engine whose graphs graphtrace could re-record, but not as the engine replays them
    (SGLang's compiled CPU graphs): it says so before being asked to re-capture."""

    def cannot_recapture(self, captures: list) -> str | None:
        return f"TestRunner compiled {', '.join(c.label for c in captures)} with its weights inside"


class Server:
    """A made-up engine (SGLang's entry points) serving a captured `Model` through the core."""

    UPDATES = frozenset({"update_weights_from_disk", "end_weight_update",
                         "resume_memory_occupation"})

    def __init__(self, folder=None, rank: int = 0, collective=None, action="raise",
                 adapter=Adapter, every_rank_raises: bool = False):
        self.model = Model()
        with torch.no_grad(), gt.trace(self.model) as trace:
            with gt.capture("decode") as self.graph:  # kept alive, as a CUDA graph would be
                self.model(torch.ones(2, 4))
        extra = {"collective": collective} if collective is not None else {}
        self.core = ServingCore(adapter(trace, rank), action, (lambda: folder) if folder else None,
                                complete=self.UPDATES, every_rank_raises=every_rank_raises,
                                **extra)
        self.core.watch_versions()  # the loaded weights: Note [in-place writes]

    # -- update entry points: each fires the core's events -----------------------------------
    def begin_weight_update(self) -> None:
        self.core.update_begin("begin_weight_update")

    def load(self, name: str, tensor: torch.Tensor) -> None:  # one chunk of a session
        with torch.no_grad():
            dict(self.model.named_parameters())[name].copy_(tensor)

    def end_weight_update(self) -> tuple[bool, str]:
        return self._answer(lambda: self.core.update_end("end_weight_update"))

    def update_weights_from_disk(self, weights: dict, rebind_scale: bool = False):
        self.core.update_begin("update_weights_from_disk")
        for name, tensor in weights.items():
            self.load(name, tensor)
        if rebind_scale:  # the bug: the holder is rebound, the graph reads the old tensor
            self.model.kernel.scale = torch.full((4,), 2.0)
        return self._answer(lambda: self.core.update_end("update_weights_from_disk"))

    def release_memory_occupation(self) -> None:
        self.core.update_begin("release_memory_occupation")

    def resume_memory_occupation(self):
        return self._answer(lambda: self.core.update_end("resume_memory_occupation"))

    # -- serving: check before the forward, refuse as the engine answers ---------------------
    def generate(self) -> dict:
        answer = self._answer(lambda: [c.check("before_forward") for c in pending()
                                       if c is self.core])
        if not answer[0]:
            return {"success": False, "message": answer[1]}
        self.graph.replay()
        return {"success": True}

    @staticmethod
    def _answer(step) -> tuple[bool, str]:
        try:
            step()
        except gt.StaleGraphError as exc:
            return False, str(exc)
        return True, "ok"


@pytest.fixture
def server(tmp_path):
    s = Server(folder=tmp_path)
    yield s
    s.core.close()


def _checks(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "checks.jsonl").read_text().splitlines()]


def test_an_engine_without_vllm_goes_through_the_whole_lifecycle(server, tmp_path):
    core = server.core
    # a session: begin -> writes -> end is one update, checked once when it ends
    server.begin_weight_update()
    server.load("proj.weight", torch.rand(4, 4))
    server.load("proj.weight", torch.rand(4, 4))
    assert core.dirty and core.checks == 0 and core.updates == ["begin_weight_update"]
    assert server.end_weight_update() == (True, "ok")
    assert core.checks == 1 and not core.dirty
    assert server.generate()["success"] and core.checks == 1  # clean: no check per forward

    # an in-place write through no entry point: seen by the version counters, checked once
    with torch.no_grad():
        server.model.proj.weight.add_(1)
    assert server.generate()["success"] and core.checks == 2
    assert core.last["updates"] == ["in-place write"]

    # a stale update: refused as this engine answers, recorded, and it stays refused
    captured = server.model.kernel.scale
    ok, message = server.update_weights_from_disk({"proj.weight": torch.rand(4, 4)},
                                                  rebind_scale=True)
    assert not ok and "kernel.scale [moved]" in message and "after update_weights_from_disk" in message
    refused = server.generate()
    assert not refused["success"] and "kernel.scale" in refused["message"]
    assert core.dirty and core.refusal is not None
    assert core.refusal_info()["message"] == refused["message"]

    # a correct update (the holder back on the captured storage, new values copied in)
    server.begin_weight_update()
    with torch.no_grad():
        captured.copy_(torch.full((4,), 3.0))
    server.model.kernel.scale = captured
    assert server.end_weight_update() == (True, "ok")
    assert server.generate()["success"] and core.refusal is None and core.refusal_info() is None

    # the record: one line per check, the problems of the refused ones beside it
    lines = _checks(tmp_path)
    assert [(e["trigger"], e["ok"]) for e in lines] == [
        ("end_weight_update", True), ("before_forward", True),
        ("update_weights_from_disk", False), ("before_forward", False),
        ("end_weight_update", True)]
    assert lines[2]["owners"] == ["kernel.scale"] and lines[2]["verdicts"] == ["stale"]
    assert "kernel.scale" in (tmp_path / lines[2]["problems_csv"]).read_text()
    assert (tmp_path / "guard.json").exists()


def test_memory_release_and_resume_is_one_update(server):
    server.release_memory_occupation()
    assert server.core.dirty and server.core.checks == 0
    assert server.resume_memory_occupation() == (True, "ok")
    assert server.core.checks == 1 and server.core.last["updates"] == ["release_memory_occupation"]


def test_recapture_asks_the_engine_and_the_problems_stand_where_it_cannot(tmp_path):
    server = Server(action="recapture")
    try:
        ok, message = server.update_weights_from_disk({}, rebind_scale=True)
        assert server.core.engine.recaptured == [["decode"]]  # asked, with the graphs to redo
        assert not ok and "kernel.scale [moved]" in message  # it could not: refused
        assert "recapture is not possible: the engine could not record" in message
        assert server.core.last["n_problems"] == 1 and server.core.last["action"] == "recapture"
        refused = server.generate()  # and it stays refused, as under raise
        assert not refused["success"] and "kernel.scale" in refused["message"]
        assert server.core.dirty and server.core.refusal_info() is not None
    finally:
        server.core.close()


def test_a_recapture_that_cannot_help_is_not_tried_and_the_engine_fails_closed(tmp_path):
    server = Server(folder=tmp_path, action="recapture", adapter=CompiledAdapter)
    core = server.core
    try:
        captured = server.model.kernel.scale
        ok, message = server.update_weights_from_disk({}, rebind_scale=True)
        assert not ok and core.engine.recaptured == []  # not asked: it said why not first
        first, rest = message.split("\n", 1)
        assert first.endswith("recapture is not possible: TestRunner compiled decode with "
                              "its weights inside")
        assert "kernel.scale [moved]" in rest
        for _ in range(2):  # every forward is refused until a correct update
            refused = server.generate()
            assert not refused["success"] and "recapture is not possible: TestRunner" in \
                refused["message"].split("\n")[0]
        assert core.dirty and core.refusal_info()["message"] == refused["message"]

        server.begin_weight_update()  # a correct update: it serves again
        server.model.kernel.scale = captured
        assert server.end_weight_update() == (True, "ok")
        assert server.generate()["success"] and not core.dirty
        lines = _checks(tmp_path)
        assert [(e["ok"], e.get("recapture_refused", "")[:10]) for e in lines] == [
            (False, "TestRunner"), (False, "TestRunner"), (False, "TestRunner"), (True, "")]
    finally:
        core.close()


class ThreadGroup:
    """An injected collective: ranks as threads, gathering through a barrier."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def collective(self, rank: int):
        def gather(value) -> list:
            self.slots[rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # every rank read the slots before the next gather
            return out
        return lambda: Ranks(rank, self.size, gather)


def _on_ranks(servers, step):
    """Run ``step(server)`` on every rank at once; each rank's (result, exception)."""
    results: list = [None] * len(servers)

    def run(i):
        try:
            results[i] = (step(servers[i]), None)
        except Exception as exc:  # noqa: BLE001 - reported per rank
            results[i] = (None, exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_ranks_that_disagree_check_together_and_the_last_raises_for_all():
    group = ThreadGroup(2)
    ranks = [Server(rank=r, collective=group.collective(r)) for r in range(2)]
    try:
        # only rank 0's update went wrong; rank 1 saw no update at all (it is clean)
        captured = ranks[0].model.kernel.scale
        ranks[0].core.update_begin("update_weights_from_disk")
        ranks[0].model.kernel.scale = torch.full((4,), 2.0)
        assert ranks[0].core.dirty and not ranks[1].core.dirty
        (entry0, exc0), (entry1, exc1) = _on_ranks(ranks, lambda s: s.core.check("before_forward"))
        assert exc0 is None and not entry0["ok"]  # rank 0 logs and records, does not raise
        assert isinstance(exc1, gt.StaleGraphError) and entry1 is None  # the last rank raises
        assert "problems in rank(s) 0 of 2" in str(exc1) and "kernel.scale" in str(exc1)
        assert list(exc1.problems["rank"]) == [0]
        assert ranks[1].core.checks == 1  # it checked although it was clean: the ranks agreed
        assert ranks[0].core.dirty and ranks[1].core.refusal is not None  # refused

        # a correct update on rank 0: both ranks serve again
        ranks[0].model.kernel.scale = captured
        results = _on_ranks(ranks, lambda s: s.core.check("before_forward"))
        assert [exc for _, exc in results] == [None, None]
        assert [e["ok"] for e, _ in results] == [True, True]
        assert not ranks[0].core.dirty and not ranks[1].core.dirty
    finally:
        for s in ranks:
            s.core.close()



def test_every_rank_raises_where_the_engine_answers_with_one_ranks_result():
    """``every_rank_raises`` (SGLang: rank 0 answers, every rank aborts the same requests):
    a stale holder on rank 1 only makes both ranks raise the same agreed error."""
    group = ThreadGroup(2)
    ranks = [Server(rank=r, collective=group.collective(r), every_rank_raises=True)
             for r in range(2)]
    try:
        ranks[1].core.update_begin("update_weights_from_disk")
        ranks[1].model.kernel.scale = torch.full((4,), 2.0)
        (_, exc0), (_, exc1) = _on_ranks(ranks, lambda s: s.core.check("update_weights_from_disk"))
        assert isinstance(exc0, gt.StaleGraphError) and isinstance(exc1, gt.StaleGraphError)
        assert "problems in rank(s) 1 of 2" in str(exc0) and "problems in rank(s) 1 of 2" in str(exc1)
        assert str(exc0).split(":", 1)[1] == str(exc1).split(":", 1)[1]  # the same problems
        assert all(s.core.dirty and s.core.refusal_info() is not None for s in ranks)
    finally:
        for s in ranks:
            s.core.close()
