"""The verdict engine (graphtrace.verdict): the rule in scalar form against its vectorised
form, owner status, and impact on the views graphs really read."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from graphtrace.verdict import (
    View,
    impact_of,
    owner_status,
    same_view,
    storage_verdicts,
    verdict_of,
)
from graphtrace.vocab import OWNER_STATUSES, VERDICTS

# every storage: 0-3 owners, each holds / moved / orphaned, x alive / dead
CASES = [(statuses, alive) for n in range(4)
         for statuses in itertools.product(OWNER_STATUSES, repeat=n)
         for alive in (True, False)]

import graphtrace as gt
from tests.test_tracing import Holder


def test_vectorised_verdicts_agree_with_verdict_of_on_every_combination():
    # all storages in one call: runs of every length side by side, as diff passes them
    status = np.array([s for statuses, _ in CASES for s in statuses], dtype=object)
    n_owners = np.array([len(statuses) for statuses, _ in CASES])
    alive = np.array([a for _, a in CASES])
    got = storage_verdicts(status, n_owners, alive)
    expected = [verdict_of(statuses, a) for statuses, a in CASES]
    assert len(CASES) == 2 * (1 + 3 + 9 + 27)
    assert list(got) == expected
    assert set(expected) == set(VERDICTS) - {"unrefreshed"}  # identity alone: all but freshness


def test_freshness_in_both_forms_of_the_rule():
    """`unrefreshed` (sources changed, not rewritten) turns what would be stable or unowned
    into unrefreshed; identity problems and internal storages come first."""
    status = np.array([s for statuses, _ in CASES for s in statuses], dtype=object)
    n_owners = np.array([len(statuses) for statuses, _ in CASES])
    alive = np.array([a for _, a in CASES])
    for internal in (np.zeros(len(CASES), dtype=bool), np.arange(len(CASES)) % 5 == 0):
        fresh = np.arange(len(CASES)) % 2 == 0
        got = storage_verdicts(status, n_owners, alive, internal, fresh)
        expected = [verdict_of(st, a, i, u) for (st, a), i, u in zip(CASES, internal, fresh)]
        assert list(got) == expected
        plain = [verdict_of(st, a, i) for (st, a), i in zip(CASES, internal)]
        for e, p, u, i in zip(expected, plain, fresh, internal):
            assert e == ("unrefreshed" if u and not i and p in ("stable", "unowned") else p)
    assert set(expected) == set(VERDICTS)
    with pytest.raises(ValueError, match="unrefreshed flag per storage"):
        storage_verdicts(status, n_owners, alive, None, fresh[:-1])


def test_a_freed_source_in_both_forms_of_the_rule():
    """`source_freed` (a handle whose source the model now keeps elsewhere) is dangling
    wherever the storage would be stable, unowned or unrefreshed, in both forms of the rule;
    internal storages and identity problems come first."""
    status = np.array([s for statuses, _ in CASES for s in statuses], dtype=object)
    n_owners = np.array([len(statuses) for statuses, _ in CASES])
    alive = np.array([a for _, a in CASES])
    i = np.arange(len(CASES))
    for internal in (np.zeros(len(CASES), dtype=bool), i % 5 == 0):
        for fresh in (i % 2 == 0, i % 3 == 0):
            freed = i % 4 < 2
            got = storage_verdicts(status, n_owners, alive, internal, fresh, freed)
            expected = [verdict_of(st, a, n, u, f)
                        for (st, a), n, u, f in zip(CASES, internal, fresh, freed)]
            assert list(got) == expected
            plain = [verdict_of(st, a, n, u) for (st, a), n, u in zip(CASES, internal, fresh)]
            for e, p, f, n in zip(expected, plain, freed, internal):
                assert e == ("dangling" if f and not n and p in ("stable", "unowned",
                                                                  "unrefreshed") else p)
    assert {"dangling", "unrefreshed", "unowned"} <= set(expected)
    with pytest.raises(ValueError, match="source_freed flag per storage"):
        storage_verdicts(status, n_owners, alive, None, None, freed[:-1])


@pytest.mark.parametrize("statuses,alive", CASES[:20])
def test_one_storage_alone_gets_the_same_verdict(statuses, alive):
    got = storage_verdicts(np.array(statuses, dtype=object), [len(statuses)], [alive])
    assert list(got) == [verdict_of(statuses, alive)]


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="one status per owner"):
        storage_verdicts(np.array(["holds"], dtype=object), [2], [True])
    with pytest.raises(ValueError, match="unknown owner status 'gone'"):
        verdict_of(["gone"], True)


def test_internal_storages_agree_with_verdict_of():
    """An owned storage every graph overwrites before reading is stable; unowned stays unowned."""
    status = np.array([s for statuses, _ in CASES for s in statuses], dtype=object)
    n_owners = np.array([len(statuses) for statuses, _ in CASES])
    alive = np.array([a for _, a in CASES])
    internal = np.arange(len(CASES)) % 3 == 0
    got = storage_verdicts(status, n_owners, alive, internal)
    expected = [verdict_of(st, a, i) for (st, a), i in zip(CASES, internal)]
    assert list(got) == expected
    assert {e for e, i, (st, _) in zip(expected, internal, CASES) if i} == {"stable", "unowned"}


def test_vectorised_rule_refuses_unknown_statuses():
    with pytest.raises(ValueError, match="unknown owner status 'gone'"):
        storage_verdicts(np.array(["holds", "gone"], dtype=object), [2], [True])


# -- owner status --------------------------------------------------------------------------

def test_owner_status_by_weak_handle_and_by_address():
    w = torch.rand(4)
    cdata = w.untyped_storage()._cdata
    assert owner_status(w, cdata) == ("holds", w.data_ptr())
    other = torch.rand(4)
    assert owner_status(other, cdata) == ("moved", other.data_ptr())
    assert owner_status(None, cdata) == ("orphaned", None)
    assert owner_status(torch.empty(4, device="meta"), cdata)[0] == "moved"
    ptr, nbytes = w.untyped_storage().data_ptr(), w.untyped_storage().nbytes()
    assert owner_status(w, None, data_ptr=ptr, nbytes=nbytes)[0] == "holds"
    assert owner_status(w, None, data_ptr=ptr, nbytes=nbytes + 4)[0] == "moved"
    assert owner_status(w, None, data_ptr=ptr, nbytes=nbytes, dead=True)[0] == "moved"


def test_owner_status_under_the_capture_time_view():
    """Note [re-laid views]: the captured storage under another view is moved; the strides
    of length-one dimensions do not count; without a view, the storage alone decides."""
    w = torch.rand(4, 8)
    cdata, view = w.untyped_storage()._cdata, View.of(w)
    assert owner_status(w, cdata, view=view)[0] == "holds"
    for geometry in [((8, 4), (4, 1), 0), ((4, 8), (1, 4), 0), ((4, 7), (8, 1), 1)]:
        relaid = torch.empty(0).set_(w.untyped_storage(), geometry[2], *geometry[:2])
        assert owner_status(relaid, cdata, view=view)[0] == "moved", geometry
        assert owner_status(relaid, cdata)[0] == "holds"
    as_int = torch.empty(0, dtype=torch.int32).set_(w.untyped_storage(), 0, (4, 8), (8, 1))
    assert owner_status(as_int, cdata, view=view)[0] == "moved"
    row = torch.rand(1, 8)
    same = torch.empty(0).set_(row.untyped_storage(), 0, (1, 8), (99, 1))
    assert owner_status(same, row.untyped_storage()._cdata, view=View.of(row))[0] == "holds"
    assert same_view(View(torch.float32, (0, 3), (3, 1), 0), View(torch.float32, (0, 3), (1, 5), 2))


# -- impact (Note [impact]) ----------------------------------------------------------------

def _impact(old: torch.Tensor, read: torch.Tensor, live: torch.Tensor):
    """The impact of a graph that read `read` (a view of `old`) when the owner now holds `live`."""
    return impact_of(old.untyped_storage(), View.of(read), live, View.of(old))


def test_a_transposed_read_of_equal_values_is_latent_with_no_note():
    w = torch.rand(6, 3)
    assert _impact(w, w.t(), w.clone()) == ("latent", "")
    changed = w.clone()
    changed[2, 1] += 1
    assert _impact(w, w.t(), changed) == ("manifest", "")


def test_a_sub_view_compares_only_what_the_graph_reads():
    w = torch.rand(6, 3)
    live = w.clone()
    live[0] += 1  # a row the graph does not read
    assert _impact(w, w[2:], live) == ("latent", "")
    assert _impact(w, w[:2], live) == ("manifest", "")
    # the live tensor at another offset of a bigger storage: the same view, relative to it
    big = torch.zeros(40)
    moved = big[10:28].view(6, 3)
    moved.copy_(w)
    assert _impact(w, w[2:], moved) == ("latent", "")


def test_a_dtype_move_is_noted_once_and_compares_values():
    w = torch.rand(5, 4)
    assert _impact(w, w.t(), w.double()) == ("latent", "dtype float32 -> float64")
    assert _impact(w, w.t(), (w + 1).double()) == ("manifest", "dtype float32 -> float64")


def test_a_real_shape_change_is_manifest_and_named():
    w = torch.rand(4, 4)
    padded = torch.zeros(4, 8)
    padded[:, :4] = w
    assert _impact(w, w, padded) == ("manifest", "shape (4, 4) -> (4, 8)")


def test_another_layout_compares_the_whole_tensor_logically():
    w = torch.rand(4, 6)
    assert _impact(w, w.t(), w.t().contiguous().t()) == ("latent", "")


def test_impact_unknown_where_nothing_can_be_compared():
    w = torch.rand(3)
    assert impact_of(None, View.of(w), w) == ("unknown", "")
    assert impact_of(w.untyped_storage(), View.of(w), torch.empty(3, device="meta")) == ("unknown", "")
    # without the owner's capture-time geometry the view stays where it was; a live tensor
    # too small to hold it reads other data
    assert impact_of(w.untyped_storage(), View.of(w), torch.rand(1))[0] == "manifest"


# -- impact through the public API: dtype and shape changes are named --------------------------

@pytest.mark.usefixtures("writer")
def test_a_dtype_move_compares_values_and_says_so():
    model = Holder()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(2, 4))
    model.double()  # new float64 storages with the same values
    report = t.diff()
    w = report.edges.set_index("owners").loc["weight"]
    assert w.verdict == "stale" and w.impact == "latent"  # same values, another dtype
    notes = [s for s in report.blind_spots if "weight" in s]
    assert notes and "dtype float32 -> float64" in notes[0]
    with torch.no_grad():
        model.weight.add_(1)
    w = t.diff().edges.set_index("owners").loc["weight"]
    assert w.impact == "manifest"
    assert len(g)


@pytest.mark.usefixtures("writer")
def test_a_shape_change_is_manifest_and_named():
    model = Holder()
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(2, 4))
    model.weight = torch.nn.Parameter(torch.cat([model.weight.detach()] * 2))  # (8, 4)
    report = t.diff()
    w = report.edges.set_index("owners").loc["weight"]
    assert w.verdict == "stale" and w.impact == "manifest"
    assert any("shape (4, 4) -> (8, 4)" in s for s in report.blind_spots)
    assert len(g)
