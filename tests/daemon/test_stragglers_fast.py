"""The fast straggler detectors (daemon and agent) answer exactly what the simple ones do."""

from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st
from simple_stragglers import SimpleStragglerDetector, simple_slower_than_others

from stalwart.agent.stragglers import slower_than_others
from stalwart.daemon.stragglers import StragglerDetector, StragglerPolicy, median_without

# Few distinct values so that ties (equal busy times, the hard case for a sorted list) are common.
_BUSY = st.one_of(st.sampled_from([0.0, -1.0, 0.1, 0.2, 0.25, 0.3, 1.0]),
                  st.floats(min_value=0.0, max_value=5.0, allow_nan=False))
_NODES = [f"n{i}" for i in range(12)]
_REPORT = st.tuples(st.sampled_from([*_NODES, "stranger"]), st.integers(0, 30), _BUSY)
_BATCH = st.lists(_REPORT, max_size=25)


@settings(max_examples=300, deadline=None)
@given(members=st.lists(st.sampled_from(_NODES), min_size=1, unique=True),
       batches=st.lists(_BATCH, max_size=8), factor=st.sampled_from([1.1, 1.5, 2.0]),
       steps=st.integers(1, 4), reset_at=st.integers(0, 8))
def test_fast_detector_equals_the_simple_one(members: list[str], batches: list[list[tuple[str, int, float]]],
                                             factor: float, steps: int, reset_at: int) -> None:
    fast = StragglerDetector(StragglerPolicy(factor, steps))
    simple = SimpleStragglerDetector(StragglerPolicy(factor, steps))
    fast.reset(members)
    simple.reset(members)
    for i, batch in enumerate(batches):
        if i == reset_at:  # a new round: everything forgotten
            fast.reset(members[::-1])
            simple.reset(members[::-1])
        for node, step, busy in batch:
            fast.report(node, step, busy)
            simple.report(node, step, busy)
        assert fast.stragglers() == simple.stragglers()
        assert fast.busy_times() == {k: n.busy for k, n in simple.nodes.items()}


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_BUSY.filter(lambda v: v > 0), max_size=15), pick=st.integers(0, 20))
def test_median_without_equals_statistics_median(values: list[float], pick: int) -> None:
    ordered = sorted(values)
    assert median_without(ordered, None) == (statistics.median(ordered) if ordered else None)
    if ordered:
        v = ordered[pick % len(ordered)]
        rest = list(ordered)
        rest.remove(v)
        assert median_without(ordered, v) == (statistics.median(rest) if rest else None)


@settings(max_examples=300, deadline=None)
@given(busy=st.dictionaries(st.integers(0, 15), _BUSY, max_size=12), factor=st.sampled_from([1.1, 1.5, 2.0]))
def test_fast_local_stragglers_equal_the_simple_ones(busy: dict[int, float], factor: float) -> None:
    assert slower_than_others(busy, factor) == simple_slower_than_others(busy, factor)
