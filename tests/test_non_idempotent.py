"""Non-idempotent steps (issue 24, Note [non-idempotent steps] in graphtrace/lineage/steps.py): while
a trace is open, outside capture regions, a registered parameter or buffer updated in place
from its own value is a finding naming the storage, the op and the line, with how many times
it ran; pure overwrites, optimizer steps, unregistered tensors and capture regions are not."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import graphtrace as gt


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(4, 4) + 0.5, requires_grad=False)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return (x @ self.weight.t()) * self.scale


def _line(fn, text: str) -> int:
    """The line of `fn`'s source that contains `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def normalise(model):
    """ROCm ATOM #2028's process step: the scale normalised in place on every sync."""
    model.scale.mul_(2.0)


def test_a_scale_normalised_in_place_each_sync_is_one_record_with_its_count_and_line():
    model = Scaled()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        for _ in range(3):
            normalise(model)
    assert torch.equal(model.scale, torch.full((4,), 8.0))  # 2^N after N syncs
    f = t.findings()
    assert len(f) == 1, f
    r = f.iloc[0]
    assert (r.kind, r.holder, r.op, r.source_kind, r.n) == (
        "non-idempotent step", "scale", "aten::mul_.Tensor", "buffer", "3")
    assert f"test_non_idempotent.py:{_line(normalise, 'mul_')}" in r.site


def test_division_by_another_tensor_and_out_aliasing_an_input_are_records():
    model = Scaled()
    s = torch.full((4, 1), 2.0)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.weight.div_(s)                               # w.div_(s)
        torch.mul(model.weight, s, out=model.weight)       # out= is also an input
        model.weight.data.add_(1.0)                        # through .data
    f = t.findings()
    assert set(f["holder"]) == {"weight"} and set(f["source_kind"]) == {"parameter"}
    assert set(f["op"]) == {"aten::div_.Tensor", "aten::mul.out", "aten::add_.Tensor"}


def test_overwrites_unregistered_tensors_and_optimizer_steps_are_not_records():
    model = Scaled()
    model.weight.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gt.trace(model, strict=True) as t:
        with torch.no_grad():
            model.scale.copy_(torch.rand(4))      # a reload: overwrite, idempotent
            model.scale.fill_(1.0)
            model.scale.zero_().add_(torch.ones(4))  # zero_ then add_: add_ reads the zeros
            tmp = torch.ones(4)
            tmp.mul_(2)                           # not registered
        model(torch.rand(2, 4)).sum().backward()
        opt.step()                                # training, not a process step
    f = t.findings()
    # only the add_ after zero_ is noted: lineage does not reason about values
    assert list(f["op"]) == ["aten::add_.Tensor"], f


def test_nothing_is_noted_inside_a_capture_region():
    model = Scaled()
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        with gt.capture("g", emulate=False):
            model.scale.mul_(2.0)
            model(torch.rand(2, 4))
    assert t.findings().empty


def test_the_records_reach_the_report_and_survive_csv(tmp_path):
    model = Scaled()
    x = torch.rand(2, 4)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        normalise(model)
        with gt.capture("g"):
            model(x)
    report = t.diff()
    assert list(report.findings["kind"]) == ["non-idempotent step"]
    assert set(report.edges["verdict"].astype(str)) <= {"stable", "unowned"}  # not a verdict
    loaded = gt.load_report(report.to_csv(tmp_path / "r"))
    assert loaded.findings.equals(report.findings)


def test_lineage_off_notes_nothing():
    model = Scaled()
    with torch.no_grad(), gt.trace(model, strict=True, lineage=False) as t:
        normalise(model)
    assert t.findings().empty


def test_the_rocm_atom_case_doubles_the_scale_per_sync_and_counts_the_syncs():
    from graphtrace.demo.cases import get
    from graphtrace.demo.cases.rocm_atom_2028_scale_normalise import SYNCS, AtomModel

    out = get("rocm-atom-2028-scale-normalise").run("buggy")
    loaded = AtomModel().checkpoint(0)["layers.0.weight_scale"]
    assert torch.allclose(out.scale[0], loaded * 2 ** (SYNCS + 1))  # first load + N syncs
    f = out.report.findings
    rows = f[f["holder"] == "layers.0.weight_scale"]
    assert sorted(rows["n"].astype(int)) == [1, SYNCS]  # the first process step, the syncs
    assert rows["site"].str.contains("rocm_atom_2028_scale_normalise.py").all()


def test_the_rocm_atom_finding_with_a_compiled_forward():
    """ROCm ATOM #2028 with the captured forward `torch.compile`d (issue 24 asks for both): the
    process step runs eagerly either way, so the finding and the doubled scale are the same."""
    from graphtrace.demo.cases.rocm_atom_2028_scale_normalise import SYNCS, AtomModel, K

    # Every case model runs CaseModel.forward, one code object: after eight other case models
    # compiled it in this process, Dynamo's recompile limit would run this one eagerly.
    torch.compiler.reset()
    torch.manual_seed(0)
    model = AtomModel(fixed=False).eval()
    forward = torch.compile(model, backend="inductor")
    x = torch.randn(2, K)
    with torch.no_grad(), gt.trace(model, strict=True) as t:
        model.load(model.checkpoint(0))
        first = [layer.weight_scale.clone() for layer in model.layers]
        with gt.capture("bs2") as g:
            forward(x)
        for _ in range(SYNCS):
            model.load_weights(model.checkpoint(1, weights_only=True))
            model.process_weights_after_loading()
    assert t.saw_compiled
    for before, layer in zip(first, model.layers):
        assert torch.equal(layer.weight_scale, before * 2 ** SYNCS)
    f = t.findings()
    f = f[f["kind"] == "non-idempotent step"]
    assert set(f["holder"]) == {f"layers.{i}.weight_scale" for i in range(len(model.layers))}, f
    # one row per call site: the first load's process step, then the syncs' (SYNCS times)
    counts = f.assign(n=f["n"].astype(int)).groupby("holder")["n"].sum()
    assert set(counts) == {1 + SYNCS}, f
    del g
