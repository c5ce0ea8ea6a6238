"""graphtrace.demo.scenario: the one capture -> reload -> diff -> replay -> flip harness,
through its public API (the demo, the case library and the kernel audit build on it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from graphtrace.demo.scenario import (  # noqa: E402
    Flip,
    Graph,
    Scenario,
    ScenarioError,
    capture,
    changed_rows,
    run,
    same_rows,
)
from graphtrace.vocab import STALE_VERDICTS  # noqa: E402


class Linear(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=g), requires_grad=False)

    def forward(self, x, scale=None):
        y = x @ self.weight.t()
        return y if scale is None else y * scale


def new_weight(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))


def inputs(*sizes):
    g = torch.Generator().manual_seed(7)
    return [(f"bs{b}", 1 + torch.rand(b, 3, generator=g)) for b in sizes]


def swap(m):  # the bug class: a new storage behind the same Parameter
    m.weight.data = new_weight()
    return "data swap"


def copy_in(m):  # the fix: new values in the captured storage
    with torch.no_grad():
        m.weight.copy_(new_weight())
    return "copy"


def negate(m):
    m.weight.neg_()
    return "the live weight, negated"


def stale_owners(report) -> set[str]:
    stale = report.edges[report.edges["verdict"].astype(str).isin(STALE_VERDICTS)]
    return {o for s in stale["owners"].astype(str) for o in s.split("; ") if o}


# --------------------------------------------------------------------------------------
# run: the whole scenario in one call
# --------------------------------------------------------------------------------------

def test_run_finds_the_stale_read_and_the_flip_leaves_the_graphs_frozen():
    out = run(Linear(), inputs(1, 2), swap, negate)
    assert out.reloaded == "data swap"
    assert stale_owners(out.report) == {"weight"}
    assert out.rows == 3 and out.replay_eq_eager == 0  # replays read the old weight
    assert out.flip == Flip("the live weight, negated", 3, 0)
    assert out.flip.frozen and not out.flip.follows


def test_run_of_an_in_place_reload_is_clean_and_the_graphs_follow_the_flip():
    out = run(Linear(), inputs(1, 2), copy_in, negate)
    assert stale_owners(out.report) == set()
    assert out.rows == 3 and out.replay_eq_eager == 3
    assert out.flip.changed == 3 and out.flip.follows


def test_run_without_replayable_graphs_only_diffs():
    out = run(Linear(), inputs(2), swap, negate, emulate=False)
    assert stale_owners(out.report) == {"weight"}
    assert (out.rows, out.replay_eq_eager, out.flip) == (0, None, None)


def test_run_without_a_perturbation_skips_the_flip():
    out = run(Linear(), inputs(2), copy_in)
    assert out.flip is None and out.replay_eq_eager == 2


# --------------------------------------------------------------------------------------
# Scenario: the steps one at a time
# --------------------------------------------------------------------------------------

def test_a_model_built_inside_the_trace_is_watched_later_and_args_may_be_tuples():
    with Scenario() as sc:
        model = Linear()
        sc.watch(model)
        graphs = sc.capture([("two-args", (torch.ones(2, 3), torch.tensor(2.0)))])
        before = sc.replay()
        sc.reload(swap)
        report = sc.diff()
    assert [type(g) for g in graphs] == [Graph] and graphs[0].inputs[1].item() == 2.0
    assert stale_owners(report) == {"weight"}
    assert same_rows(sc.replay()[0], before[0]) == 2  # the graph reads the old storage
    assert same_rows(sc.eager()[0], before[0]) == 0


def test_a_reload_after_the_trace_closed_still_diffs():
    with Scenario(Linear()) as sc:
        sc.capture(inputs(2))
    sc.reload(swap)
    assert stale_owners(sc.diff()) == {"weight"}


def test_flip_restores_and_counts_eager_rows():
    model = Linear()
    with Scenario(model) as sc:
        sc.capture(inputs(1, 2))
        sc.reload(swap)
    weight = model.weight.detach().clone()
    flip = sc.flip(lambda m: m.weight.neg_(), restore=lambda m: m.weight.neg_(), eager=True)
    assert (flip.target, flip.rows, flip.changed, flip.eager_changed) == ("", 3, 0, 3)
    assert torch.equal(model.weight, weight)


def test_flip_restores_even_when_the_replay_fails():
    model = Linear()
    with Scenario(model) as sc:
        sc.capture(inputs(2), emulate=False)
    with pytest.raises(ScenarioError, match="emulate=False"):
        sc.flip(negate, restore=negate, baseline=[torch.zeros(2, 4)])
    assert torch.equal(model.weight, Linear().weight)


def test_capture_function_records_in_an_open_trace():
    import graphtrace as gt

    model = Linear()
    with gt.trace(model) as tr:
        (graph,) = capture(model, inputs(2))
    assert graph.label == "bs2" and graph.rows == 2 and graph.replayable
    assert list(tr.diff().edges["graph"].astype(str).unique()) == ["bs2"]


def test_rows_compare_row_by_row():
    a = torch.zeros(3, 2, 2)
    b = a.clone()
    b[1, 0, 1] = 1
    assert same_rows(a, b) == 2 and changed_rows(a, b) == 1


@pytest.mark.parametrize("shape", [(), (3,), (3, 2), (3, 2, 2)])
@pytest.mark.parametrize("change", [None, 0.5, float("nan"), -0.0])
def test_any_changed_row_means_the_outputs_are_not_equal(shape, change):
    # the kernel audit reads `changed > 0` as "the output changed" (it used torch.equal on
    # whole outputs): the same answer for every shape, NaN included (NaN != NaN), -0.0 == 0.0
    a = torch.zeros(shape, dtype=torch.bfloat16)
    b = a.clone()
    if change is not None:
        b.view(-1)[-1] = change
    assert (changed_rows(a, b) > 0) == (not torch.equal(a, b))
    nan = torch.full(shape, float("nan"))
    assert changed_rows(nan, nan.clone()) > 0 and not torch.equal(nan, nan.clone())


# --------------------------------------------------------------------------------------
# bad input: one clear ScenarioError
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ([], "inputs is empty"),
    (torch.ones(2, 3), "pairs, got Tensor"),
    ([torch.ones(2, 3)], r"inputs\[0\] must be a \(label, tensor"),
    ([("", torch.ones(2, 3))], "label must be a non-empty str"),
    ([("a", "not a tensor")], r"inputs\[0\] \('a'\): the model's first argument must be a tensor"),
    ([("a", torch.ones(1, 3)), ("a", torch.ones(2, 3))], "'a' is used twice"),
])
def test_bad_inputs_are_one_clear_error(bad, message):
    with Scenario(Linear()) as sc:
        with pytest.raises(ScenarioError, match=message):
            sc.capture(bad)
        assert sc.graphs == []


def test_a_bad_device_is_a_clear_error():
    with Scenario(Linear()) as sc:
        with pytest.raises(ScenarioError, match="not a torch device"):
            sc.capture(inputs(1), device="gpu0")
        if not torch.cuda.is_available():
            with pytest.raises(ScenarioError, match="CUDA is not available"):
                sc.capture(inputs(1), device="cuda")


def test_steps_out_of_order_are_clear_errors():
    sc = Scenario(Linear())
    with pytest.raises(ScenarioError, match="capture inside the open trace"):
        sc.capture(inputs(1))
    with pytest.raises(ScenarioError, match="before the trace is open"):
        sc.diff()
    with pytest.raises(ScenarioError, match="nothing to replay"):
        sc.replay()
    with sc:
        with pytest.raises(ScenarioError, match="reload before any capture"):
            sc.reload(swap)
    with pytest.raises(ScenarioError, match="entered once"):
        sc.__enter__()
    with Scenario() as empty:
        with pytest.raises(ScenarioError, match="no model"):
            empty.capture(inputs(1))


def test_outputs_of_different_shapes_do_not_compare():
    with pytest.raises(ScenarioError, match=r"shapes \(2, 4\) and \(3, 4\)"):
        same_rows(torch.zeros(2, 4), torch.zeros(3, 4))
    with Scenario(Linear()) as sc:
        sc.capture(inputs(1, 2))
    with pytest.raises(ScenarioError, match="baseline has 1 outputs for 2 graphs"):
        sc.flip(negate, baseline=[torch.zeros(1, 4)])


class BufferOut(Linear):
    """Returns one output buffer it overwrites on every call, as some engine kernels do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("out", torch.zeros(2, 4))

    def forward(self, x):
        return torch.matmul(x, self.weight.t(), out=self.out)


def test_eager_outputs_are_copies_so_the_flip_sees_eager_changes():
    with Scenario(BufferOut(), strict=False) as sc:
        sc.capture(inputs(2))
    flip = sc.flip(negate, restore=negate, eager=True)
    assert flip.eager_changed == 2 and flip.changed == 2
