"""A tensor re-laid in its captured storage under another view is judged by the view the graph
reads (Note [re-laid views] in graphtrace/verdict.py): stale, naming both views, where the
owner now holds another dtype, shape, stride or offset; stable where it holds the view it had
at capture. Public API only (`gt.trace`, `gt.capture`, `t.diff()`, `t.guard()`, a guard
loaded from JSON), diff and guards agreeing (`assert_agree`); each replay shows what the
graph reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphtrace as gt
from tests.test_differential import assert_agree

# both writers: the native one's guard decides a clean check in C++ (views compared there),
# the Python one's resolves every owner (Note [re-laid views] in graphtrace/verdict.py)
pytestmark = pytest.mark.usefixtures("writer")


class Linear(nn.Module):
    """`x @ w`, and a graph that also reads w transposed (a view of its own: no alarm)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(4, 8), requires_grad=False)

    def forward(self, x):
        return x @ self.w + (self.w.t() @ x.t()).t()


def _captured(tmp_path):
    m, x = Linear(), torch.rand(2, 4)
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        with gt.capture("g") as g:
            out = m(x)
    guard = t.guard()
    loaded = gt.load_guard(guard.to_json(tmp_path / "guard.json"), m)
    return m, x, t, g, out, [guard, loaded]


def _relay(m, dtype, shape, stride, offset=0):
    """Bind `m.w` to a view of its own storage, as a direct reload does (`.data = view`)."""
    view = torch.empty(0, dtype=dtype).set_(m.w.untyped_storage(), offset, shape, stride)
    m.w.data = view
    return view


def _verdicts(t, guards):
    report = t.diff()
    assert_agree(t, guards, report)
    e = report.edges[report.edges["owners"].astype(str) == "w"]
    notes = [b["text"] for b in report.meta["blind_spots"] if "re-laid" in b["text"]]
    return set(e["verdict"].astype(str)), set(e["impact"].astype(str)), notes


# (what the owner holds after the reload) -> the line the note names it by
RELAID = {
    "shape": ((torch.float32, (8, 4), (4, 1)), "float32 (8, 4) stride (4, 1) offset 0"),
    "stride": ((torch.float32, (4, 8), (1, 4)), "float32 (4, 8) stride (1, 4) offset 0"),
    "dtype": ((torch.int32, (4, 8), (8, 1)), "int32 (4, 8) stride (8, 1) offset 0"),
    "offset": ((torch.float32, (4, 7), (8, 1), 1), "float32 (4, 7) stride (8, 1) offset 1"),
}


@pytest.mark.parametrize("change", list(RELAID))
def test_another_view_of_the_captured_storage_is_stale_naming_both_views(change, tmp_path):
    m, x, t, g, out, guards = _captured(tmp_path)
    (dtype, shape, stride, *offset), text = RELAID[change]
    with torch.no_grad():
        _relay(m, dtype, shape, stride, *offset)
        if dtype.is_floating_point:
            m.w.copy_(torch.rand(shape))  # the loader writes the new weights in that view
        g.replay()
    verdicts, impacts, notes = _verdicts(t, guards)
    assert verdicts == {"stale"}
    assert impacts <= {"manifest", "latent"} and impacts
    assert len(notes) >= 1
    for note in notes:
        assert "the graph reads float32" in note and f"the owner now holds {text}" in note
    # the guard names both views too, in its row and in its refusal
    problems = guards[0].check()
    assert set(problems["statuses"]) == {"moved"}
    assert all(f"the owner now holds {text}" in n for n in problems["note"])
    with pytest.raises(gt.StaleGraphError, match="re-laid in the captured storage"):
        guards[0].enforce()


def test_the_captured_view_bound_again_is_stable(tmp_path):
    """A direct reload's round trip: the checkpoint view, the loader's write, then the view
    the graph reads bound again (a new tensor object): fresh, and the replay reads the new
    weights right."""
    m, x, t, g, out, guards = _captured(tmp_path)
    new = torch.rand(4, 8)
    with torch.no_grad():
        _relay(m, torch.float32, (8, 4), (4, 1)).copy_(new.t())  # checkpoint layout
        _relay(m, torch.float32, (4, 8), (1, 4))  # the transposed view of what was written
        runtime = m.w.contiguous()
        _relay(m, torch.float32, (4, 8), (8, 1)).copy_(runtime)  # laid out as at capture
        g.replay()
    assert _verdicts(t, guards)[0] == {"stable"}
    assert all(gd.check().empty for gd in guards)
    assert torch.allclose(out, 2 * (x @ new))


def test_strides_of_length_one_dimensions_are_not_compared(tmp_path):
    """A (1, 8) view with another stride on its length-one dimension addresses the same
    elements: not a re-lay."""
    class Row(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(1, 8), requires_grad=False)

        def forward(self, x):
            return x * self.w

    m = Row()
    with torch.no_grad(), gt.trace(m, strict=True) as t:
        with gt.capture("g"):
            m(torch.rand(2, 8))
    guard = t.guard()
    _relay(m, torch.float32, (1, 8), (99, 1))
    assert _verdicts(t, [guard])[0] == {"stable"}
    assert guard.check().empty
    _relay(m, torch.float32, (2, 4), (4, 1))  # now another shape: stale
    assert _verdicts(t, [guard])[0] == {"stale"}
