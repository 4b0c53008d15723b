"""When a batch job running a stalwart world is over (stalwart slurm wait's decision)."""

from __future__ import annotations

from stalwart.daemon.outcome import Outcome, decide

BASE = dict(until_step=100, round_open=True, gave_up="", leading=True, status_reason="", unformed_since=None,
            now=1000.0, form_timeout=60.0)


def test_done_once_the_last_step_committed() -> None:
    assert decide(committed_step=99, **BASE).outcome is Outcome.RUNNING  # type: ignore[arg-type]
    assert decide(committed_step=100, **BASE).outcome is Outcome.DONE  # type: ignore[arg-type]


def test_no_world_for_the_timeout_ends_the_job_with_the_daemons_reason() -> None:
    waiting = {**BASE, "round_open": False, "status_reason": "waiting for 2 healthy nodes (1 registered)"}
    assert decide(committed_step=40, **{**waiting, "unformed_since": 950.0}).outcome is Outcome.RUNNING  # type: ignore[arg-type]
    v = decide(committed_step=40, **{**waiting, "unformed_since": 900.0})  # type: ignore[arg-type]
    assert v.outcome is Outcome.CANNOT_FORM and "waiting for 2 healthy nodes" in v.reason
    v = decide(committed_step=40, **{**waiting, "unformed_since": 900.0, "leading": False})  # type: ignore[arg-type]
    assert v.outcome is Outcome.CANNOT_FORM and "no daemon leads" in v.reason


def test_a_job_that_gave_up_ends_at_once() -> None:
    v = decide(committed_step=40, **{**BASE, "gave_up": "node n1: loss is NaN"})  # type: ignore[arg-type]
    assert v.outcome is Outcome.GAVE_UP
