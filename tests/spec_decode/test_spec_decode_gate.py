"""`SpeculationGate`: no speculation above `disable_by_batch_size`; a request whose acceptance over its window is
below `min_acceptance_rate` stops for `acceptance_cooldown` steps (or for good), then starts over."""

from __future__ import annotations

import numpy as np

from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.spec_decode.gate import SpeculationGate


def gate(**kw) -> SpeculationGate:
    return SpeculationGate(SpeculativeConfig(num_speculative_tokens=4, method="ngram", **kw), max_rows=8)


def test_batch_size_switch():
    assert gate().batch_enabled(10_000)
    g = gate(disable_by_batch_size=4)
    assert g.batch_enabled(4) and not g.batch_enabled(5)


def test_default_never_switches_a_request_off():
    g = gate()
    for _ in range(100):
        g.record(np.array([0]), np.array([4]), np.array([0]))
    assert g.allowed(np.array([0])).all()


def test_low_acceptance_switches_off_after_a_full_window_then_comes_back():
    g = gate(min_acceptance_rate=0.5, acceptance_window=4, acceptance_cooldown=3)
    rows = np.array([0, 1])
    for _ in range(3):  # row 0 accepts 1 of 4, row 1 all: not judged before the window is full
        g.record(rows, np.array([4, 4]), np.array([1, 4]))
        assert g.allowed(rows).tolist() == [True, True]
    g.record(rows, np.array([4, 4]), np.array([1, 4]))
    assert g.allowed(rows).tolist() == [False, True]
    # steps without proposals do not fill the window; the cooldown counts decode steps
    for _ in range(2):
        g.record(rows, np.array([0, 0]), np.array([0, 0]))
        assert g.allowed(rows).tolist() == [False, True]
    g.record(rows, np.array([0, 4]), np.array([0, 4]))
    assert g.allowed(rows).tolist() == [True, True]
    # back with an empty window: three more poor steps are not judged yet
    for _ in range(3):
        g.record(rows, np.array([4, 4]), np.array([0, 4]))
    assert g.allowed(rows).tolist() == [True, True]


def test_the_rate_is_over_the_last_window_only():
    g = gate(min_acceptance_rate=0.5, acceptance_window=2, acceptance_cooldown=0)
    row = np.array([3])
    g.record(row, np.array([4]), np.array([0]))  # one poor step, then good ones push it out of the window
    g.record(row, np.array([4]), np.array([4]))
    assert g.allowed(row).all()  # (0 + 4) / 8 = 0.5: not below
    g.record(row, np.array([2]), np.array([2]))
    g.record(row, np.array([3]), np.array([1]))  # last two: 3 of 5 accepted
    assert g.allowed(row).all()
    g.record(row, np.array([4]), np.array([0]))  # last two: 1 of 7
    assert not g.allowed(row).any()
    for _ in range(50):  # cooldown 0: for good
        g.record(row, np.array([0]), np.array([0]))
    assert not g.allowed(row).any()


def test_reset_and_move_follow_the_persistent_batch():
    g = gate(min_acceptance_rate=0.9, acceptance_window=1, acceptance_cooldown=10)
    g.record(np.array([5]), np.array([4]), np.array([0]))
    assert not g.allowed(np.array([5])).any()
    g.move(np.array([5]), np.array([2]))  # condensed: the request moved from row 5 to row 2
    assert not g.allowed(np.array([2])).any()
    g.reset(np.array([5]))  # a new request in row 5
    assert g.allowed(np.array([5])).all()
