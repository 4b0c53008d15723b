"""When a batch job (Slurm) that runs a stalwart world is over, and why: a pure decision.

A scheduler's job must end by itself: with success once training reached its last step (a
checkpoint at that step committed: the one marker that outlives the workers), with a failure once
the world can no longer be formed (no open round for ``form_timeout``, the daemon's status saying
why), or when the job gave up (training diverged). The launcher polls etcd (``stalwart slurm
wait``) and calls :func:`decide` with what it read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Outcome", "Verdict", "decide"]


class Outcome(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    CANNOT_FORM = "cannot-form"
    GAVE_UP = "gave-up"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str


def decide(*, committed_step: int | None, until_step: int, round_open: bool, gave_up: str, leading: bool,
           status_reason: str, unformed_since: float | None, now: float, form_timeout: float) -> Verdict:
    """``unformed_since``: when the caller first saw no open round (None while one is open)."""
    if committed_step is not None and committed_step >= until_step:
        return Verdict(Outcome.DONE, f"training reached step {committed_step} (last step {until_step})")
    if gave_up:
        return Verdict(Outcome.GAVE_UP, gave_up)
    if round_open or unformed_since is None or now - unformed_since < form_timeout:
        return Verdict(Outcome.RUNNING, "round open" if round_open else "waiting for a world")
    if not leading:
        why = "no daemon leads the job"
    else:
        why = status_reason or "no round opened"
    return Verdict(Outcome.CANNOT_FORM, f"no world for {now - unformed_since:.0f}s: {why}")
