"""vocab.verdict_of (the rule, scalar) against diff's vectorised per-storage verdicts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from graphtrace.diff import storage_verdicts
from graphtrace.vocab import OWNER_STATUSES, VERDICTS, verdict_of

# every storage: 0-3 owners, each holds / moved / orphaned, x alive / dead
CASES = [(statuses, alive) for n in range(4)
         for statuses in itertools.product(OWNER_STATUSES, repeat=n)
         for alive in (True, False)]


def test_vectorised_verdicts_agree_with_verdict_of_on_every_combination():
    # all storages in one call: runs of every length side by side, as diff passes them
    status = np.array([s for statuses, _ in CASES for s in statuses], dtype=object)
    n_owners = np.array([len(statuses) for statuses, _ in CASES])
    alive = np.array([a for _, a in CASES])
    got = storage_verdicts(status, n_owners, alive)
    expected = [verdict_of(statuses, a) for statuses, a in CASES]
    assert len(CASES) == 2 * (1 + 3 + 9 + 27)
    assert list(got) == expected
    assert set(expected) == set(VERDICTS)  # every verdict is reached


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
