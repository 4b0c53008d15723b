"""Where a chaos run's time went: the training time each fault cost, and badput by cause.

Pure: step samples, faults and rounds in (seconds since the run started), figures out. The rules:

- **A step's normal cost** is the run's median gap between consecutive steps of one round.
- **A pause** is a gap between consecutive steps longer than twice that; what it exceeds the
  normal cost by is lost. It is charged to the fault injected last *before* the pause began (the
  step before it, plus one normal step), if training had not settled since that fault (settled:
  ``SETTLED_STEPS`` normal steps in a row): a fault injected during a pause did not start it, so a
  pause caused by an earlier fault's recovery stays that fault's even when another overlaps it,
  and a pause long after a fault, once training ran steadily again, is not charged to it. A pause
  around a regrow round is the last part of the recovery of whatever took the joining nodes out:
  it is charged to the latest fault aimed at one of them. A control-plane fault (``CONTROL_PLANE``:
  its workers train on through it) that a data-plane fault follows before the gap became a pause
  (within two normal steps of the last step) is not the pause's cause, that fault is: the step
  that did not come was stopped by the data plane, however long the control plane's absence made
  its decision; so is one that follows no fault there. Other pauses are ``other``.
- **Redone steps**: a step trained again after a rollback or a restore from an older checkpoint
  wasted its earlier executions; their time is charged to the fault of the first pause, or step
  back without one (a restore within a normal step), after the wasted execution: where the
  rollback or restore happened (``recomputation``).
- **Startup** is the time to the first step, less one normal step.
- A pause is split by phase where the fault says when it was detected and the runner saw the
  round that followed: ``detection`` (injection to detection), ``decision`` (detection to the new
  round), ``re-form and restore`` (the round to the first step after it); the rest of a pause,
  or all of it when the fault has no such times, is ``stall``.
- Gaps up to twice the normal cost are not pauses; what they exceed it by is ``slow steps``.
- After the last step (the final save, the workers' exit) is ``finish``.

So ``training + startup + sum(per fault) + other + slow steps + uncommitted + finish`` equals the wall time.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

SETTLED_STEPS = 10
# Faults after which the workers train on: alone they never stop a step.
CONTROL_PLANE = frozenset({"kill-agent", "restart-agent", "kill-daemon", "kill-etcd", "lose-quorum"})

CAUSES = ("startup", "detection", "decision", "re-form and restore", "stall", "recomputation", "slow steps",
          "uncommitted", "finish", "other")


class _Sample(Protocol):
    t: float
    step: int
    round: int


class _Fault(Protocol):
    kind: str
    target: str
    injected_at: float
    detected_at: float | None


class _Round(Protocol):
    t: float
    reason: str
    members: tuple[str, ...]


@dataclass
class Accounting:
    wall_s: float
    training_s: float = 0.0  # committed steps, each at its own cost up to the normal one
    normal_step_s: float = 0.0
    lost_by_fault: list[float] = field(default_factory=list)  # same order as the faults given
    redone_by_fault: list[int] = field(default_factory=list)  # steps trained again because of each fault
    badput: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    bands: list[tuple[str, float, float]] = field(default_factory=list)  # (cause, start, end) of each pause phase

    @property
    def goodput(self) -> float:
        return self.training_s / self.wall_s if self.wall_s > 0 else 0.0


def account(samples: Sequence[_Sample], faults: Sequence[_Fault], rounds: Sequence[_Round], wall_s: float,
            committed_step: int) -> Accounting:
    """Split ``wall_s`` as the module docstring says. ``rounds``: each new round as it was seen,
    in order."""
    round_times = [r.t for r in rounds]
    acc = Accounting(wall_s, lost_by_fault=[0.0] * len(faults), redone_by_fault=[0] * len(faults))
    ordered = sorted(samples, key=lambda s: s.t)
    if not ordered:
        acc.badput["other"] = wall_s
        return acc
    gaps = [b.t - a.t for a, b in zip(ordered, ordered[1:], strict=False)
            if b.round == a.round and b.step == a.step + 1]
    normal = statistics.median(gaps) if gaps else 0.0
    acc.normal_step_s = normal
    by_time = sorted(range(len(faults)), key=lambda i: faults[i].injected_at)
    injected = [faults[i].injected_at for i in by_time]
    settled = {i: _settled_at(ordered, faults[i].injected_at, normal) for i in by_time}

    def culprit(before: float, until: float | None = None) -> int | None:
        if until is not None:
            joiner_fault = _regrow_culprit(rounds, faults, by_time, before, until)
            if joiner_fault is not None:
                return joiner_fault
        k = bisect.bisect_right(injected, before)
        prior = by_time[k - 1] if k > 0 and before < settled[by_time[k - 1]] else None
        if until is not None and normal > 0 and (prior is None or faults[prior].kind in CONTROL_PLANE):
            # A data-plane fault that hit the step in flight stopped it, not the control plane.
            last = bisect.bisect_right(injected, before + normal)
            data = [j for j in by_time[k:last] if faults[j].kind not in CONTROL_PLANE]
            if data:
                return data[0]
        return prior

    # For each execution, the culprit of the first pause or step back after it (a rollback's
    # cause: a fast restore, a regrow that re-formed within a step, goes back without a pause).
    next_pause: list[int | None] = [None] * len(ordered)
    following: int | None = None
    for i in range(len(ordered) - 1, -1, -1):
        next_pause[i] = following
        if i > 0 and normal > 0 and (ordered[i].t - ordered[i - 1].t > 2 * normal
                                     or ordered[i].step <= ordered[i - 1].step):
            following = culprit(ordered[i - 1].t + normal, ordered[i].t)

    last_of_step = {s.step: i for i, s in enumerate(ordered)}
    startup = max(0.0, ordered[0].t - normal)
    acc.badput["startup"] = startup
    if startup > 0:
        acc.bands.append(("startup", 0.0, startup))
    acc.training_s += ordered[0].t - startup  # the first step at its normal cost
    for i in range(1, len(ordered)):
        prev, cur = ordered[i - 1], ordered[i]
        gap = cur.t - prev.t
        step_cost = min(gap, normal) if normal > 0 else gap
        if normal > 0 and gap > 2 * normal:
            lost = gap - normal
            pause_fault = culprit(prev.t + normal, cur.t)
            if pause_fault is None:
                acc.badput["other"] += lost
                acc.bands.append(("other", prev.t + normal, cur.t))
            else:
                acc.lost_by_fault[pause_fault] += lost
                _split_pause(acc, faults[pause_fault], prev.t + normal, cur.t, round_times)
        else:
            step_cost = gap
            excess = max(0.0, gap - normal) if normal > 0 else 0.0
            step_cost -= excess
            acc.badput["slow steps"] += excess
        redone = last_of_step[cur.step] != i
        if redone:  # trained again later: this execution's normal cost was wasted too
            cause = next_pause[i]
            if cause is None:
                acc.badput["other"] += step_cost
            else:
                acc.lost_by_fault[cause] += step_cost
                acc.redone_by_fault[cause] += 1
                acc.badput["recomputation"] += step_cost
        elif cur.step > committed_step:
            acc.badput["uncommitted"] += step_cost
        else:
            acc.training_s += step_cost
    if last_of_step[ordered[0].step] != 0:  # the very first step was redone
        acc.training_s -= ordered[0].t - startup
        acc.badput["recomputation"] += ordered[0].t - startup
    acc.badput["finish"] += max(0.0, wall_s - ordered[-1].t)  # after the last step: the final save, exit
    return acc


def _regrow_culprit(rounds: Sequence[_Round], faults: Sequence[_Fault], by_time: Sequence[int], start: float,
                    end: float) -> int | None:
    """For a pause [start - one step, end] around a regrow round: the latest fault, injected before
    the pause, aimed at a node that the regrow took back in — before that node left the world, when
    it was in one: a fault that reached it while it was out (its agent killed while it warmed a
    spare) did not take it out, so its regrow is not that fault's."""
    for k, rnd in enumerate(rounds):
        if not rnd.reason.startswith("regrow") or not start - 1.0 <= rnd.t <= end or k == 0:
            continue
        joiners = set(rnd.members) - set(rounds[k - 1].members)
        aimed = [i for i in by_time if faults[i].target in joiners
                 and faults[i].injected_at <= min(start, _left_at(rounds, k, faults[i].target))]
        if aimed:
            return aimed[-1]
    return None


def _left_at(rounds: Sequence[_Round], k: int, node: str) -> float:
    """When ``node``, not in round ``k - 1``, last left the world before round ``k`` (the round
    that first went on without it); infinity if it was in no earlier round."""
    for m in range(k - 2, -1, -1):
        if node in rounds[m].members:
            return rounds[m + 1].t
    return float("inf")


def _settled_at(ordered: Sequence[_Sample], since: float, normal: float) -> float:
    """When training had run ``SETTLED_STEPS`` normal steps in a row after ``since`` (inf: never)."""
    run = 0
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.t <= since:
            continue
        run = run + 1 if b.t - a.t <= 2 * normal else 0
        if run >= SETTLED_STEPS:
            return b.t
    return float("inf")


def _split_pause(acc: Accounting, fault: _Fault, start: float, end: float, round_times: Sequence[float]) -> None:
    """Add the pause [start, end] to the badput causes by phase (see the module docstring)."""
    marks: list[tuple[str, float]] = []
    if fault.detected_at is not None and fault.detected_at >= fault.injected_at:
        marks.append(("detection", fault.detected_at))
        k = bisect.bisect_left(round_times, fault.detected_at)
        if k < len(round_times) and round_times[k] <= end:
            marks.append(("decision", round_times[k]))
            marks.append(("re-form and restore", end))
    t = start
    for cause, until in marks:
        until = min(max(until, t), end)
        acc.badput[cause] += until - t
        if until > t:
            acc.bands.append((cause, t, until))
        t = until
    acc.badput["stall"] += end - t
    if end > t:
        acc.bands.append(("stall", t, end))
