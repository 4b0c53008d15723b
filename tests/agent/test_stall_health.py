"""Pure rules: the learned stall timeout, and the classification of GPU findings."""

from __future__ import annotations

import pytest

from stalwart.agent.health import FakeProbe, Severity, classify_xid, verdict
from stalwart.agent.stall import StallDetector, StallPolicy


def test_first_step_gets_the_long_allowance() -> None:
    d = StallDetector(StallPolicy(floor=1, factor=4, first_step=30))
    d.started(0, now=0)
    assert d.check(now=29) == []
    stalls = d.check(now=31)
    assert [s.rank for s in stalls] == [0] and stalls[0].last_step == -1


def test_timeout_is_learned_from_step_times_with_a_floor() -> None:
    d = StallDetector(StallPolicy(floor=1, factor=4, first_step=30))
    d.started(0, now=0)
    t = 0.0
    for step in range(20):
        t += 0.5
        d.step(0, step, 0.5, now=t)
    assert d.timeout(0) == pytest.approx(2.0)  # 4 × median 0.5
    assert d.check(now=t + 1.9) == []
    assert [s.rank for s in d.check(now=t + 2.1)] == [0]
    assert d.check(now=t + 5) == []  # reported once
    d.step(0, 20, 0.5, now=t + 6)  # moving again
    fast = StallDetector(StallPolicy(floor=1, factor=4, first_step=30))
    fast.started(0, now=0)
    fast.step(0, 0, 0.01, now=0.01)
    assert fast.timeout(0) == 1  # the floor


def test_slow_but_moving_worker_is_not_a_stall() -> None:
    d = StallDetector(StallPolicy(floor=1, factor=4, first_step=30))
    d.started(0, now=0)
    t = 0.0
    for step in range(200):
        t += 0.5 * (1 + step / 100)  # steadily slower, never stopping
        d.step(0, step, 0.5 * (1 + step / 100), now=t)
        assert d.check(now=t) == []


def test_repeated_step_report_is_not_progress() -> None:
    d = StallDetector(StallPolicy(floor=1, factor=2, first_step=5))
    d.started(0, now=0)
    d.step(0, 1, 0.1, now=1)
    d.step(0, 1, 0.1, now=1.9)
    assert [s.rank for s in d.check(now=2.1)] == [0]


def test_quiet_long_before_a_stall_learned_from_step_times_and_reported_per_step() -> None:
    d = StallDetector(StallPolicy(floor=10, factor=10, first_step=300, quiet_floor=0.5, quiet_steps=4))
    d.started(0, now=0)
    assert d.quiet(now=100) == []  # no step yet: starting up, not waiting on a peer
    t = 0.0
    for step in range(10):
        t += 0.25
        d.step(0, step, 0.25, now=t)
    assert d.quiet(now=t + 0.9) == []  # within 4 × 0.25 s
    assert d.quiet(now=t + 1.1) == [(0, 9)]
    assert d.quiet(now=t + 2.0) == [(0, 9)]  # the caller checks once per (round, step)
    assert d.check(now=t + 2.0) == []  # far from the 10 s stall
    d.step(0, 10, 0.25, now=t + 2.1)
    assert d.quiet(now=t + 2.2) == []
    fast = StallDetector(StallPolicy(quiet_floor=0.5, quiet_steps=4))
    fast.started(1, now=0)
    fast.step(1, 0, 0.01, now=0.01)
    assert fast.quiet(now=0.4) == [] and fast.quiet(now=0.6) == [(1, 0)]  # the floor
    assert [s.rank for s in fast.check(now=20)] == [1]
    assert fast.quiet(now=21) == []  # a stalled worker is the stall rule's


def test_bad_stall_policy() -> None:
    with pytest.raises(ValueError):
        StallPolicy(floor=0)
    with pytest.raises(ValueError):
        StallPolicy(quiet_steps=0.5)


def test_xid_classification() -> None:
    assert classify_xid(79, 0, "t").severity is Severity.FATAL
    assert classify_xid(48, 0, "t").severity is Severity.FATAL
    assert classify_xid(94, 0, "t").severity is Severity.TRANSIENT
    assert classify_xid(13, 0, "t").severity is Severity.TRANSIENT


def test_fake_probe_verdicts() -> None:
    probe = FakeProbe(devices=2)
    assert verdict(probe.poll()) is Severity.OK
    probe.inject("xid", device=1, code=94)
    assert verdict(probe.poll()) is Severity.TRANSIENT
    probe.inject("xid", device=0, code=79)
    assert verdict(probe.poll()) is Severity.FATAL
    probe.clear()
    assert probe.poll() == []
    with pytest.raises(ValueError):
        probe.inject("xid", device=5, code=79)
    with pytest.raises(ValueError):
        probe.inject("meteor")
def test_a_frozen_worker_is_stalled_after_frozen_after_even_before_its_first_step() -> None:
    d = StallDetector(StallPolicy(floor=10, factor=4, first_step=300, frozen_after=2))
    d.started(0, now=0)
    d.started(1, now=0)
    d.frozen(0, True, now=5)  # SIGSTOPped while starting up
    d.frozen(1, False, now=5)
    assert d.check(now=6.9) == []
    stalls = d.check(now=7.1)
    assert [s.rank for s in stalls] == [0] and stalls[0].timeout == 2
    d.frozen(1, True, now=8)
    d.frozen(1, False, now=9)  # continued before the floor: still starting up
    assert d.check(now=20) == []


def test_a_frozen_worker_is_stalled_long_before_the_floor_but_not_within_one_of_its_steps() -> None:
    d = StallDetector(StallPolicy(floor=10, factor=4, first_step=300, frozen_after=1))
    d.started(0, now=0)
    d.started(1, now=0)
    for step in range(1, 6):
        d.step(0, step, 0.1, now=step * 0.1)  # fast steps: the 1 s floor of frozen_after applies
        d.step(1, step, 1.4, now=step * 1.4)  # slow steps: one of them (1.4 s) applies
    d.frozen(0, True, now=8)
    d.frozen(1, True, now=8)
    assert d.check(now=8.9) == []
    assert [s.rank for s in d.check(now=9.1)] == [0]
    assert d.check(now=9.3) == []
    assert [s.rank for s in d.check(now=9.5)] == [1]
    assert d.frozen_limit(0) == 1 and d.frozen_limit(1) == 1.4


def test_a_stopped_fast_worker_is_stalled_within_a_third_of_a_second_by_default() -> None:
    """SIGSTOP leaves nothing to wait for: its peers stand still in their collectives meanwhile.
    The agent's own slow-worker fault, which stops its target in bursts, is left out by the agent."""
    d = StallDetector(StallPolicy())
    d.started(0, now=0)
    for step in range(1, 6):
        d.step(0, step, 0.05, now=step * 0.05)
    d.frozen(0, True, now=1.0)
    assert d.check(now=1.25) == []
    assert [s.rank for s in d.check(now=1.35)] == [0]
