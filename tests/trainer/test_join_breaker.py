"""The breaker of a superseded join or world formation (trainer/reform.py), with real threads.

A form that the cut of its connections cannot reach (here a wait on an event; in a run, gloo
retrying a connection that a dead peer refuses) must not hold the rank until gloo's timeout:
the process exits for a spare to take its rank. A form that the cut ends is only superseded.
"""

from __future__ import annotations

import threading
import time

import pytest

from stalwart.trainer.reform import JoinSuperseded, within_round


def test_a_form_the_cut_cannot_end_exits_the_process_once_it_stays_blocked() -> None:
    release, exited = threading.Event(), threading.Event()

    def exit_process() -> None:  # stands in for os._exit(EXIT_STUCK), which would end the test run
        exited.set()
        release.set()

    started = time.monotonic()
    with pytest.raises(JoinSuperseded):
        within_round(6, lambda: True, lambda: release.wait(60), stuck_after=0.5, exit_process=exit_process)
    assert exited.is_set()
    assert time.monotonic() - started < 30  # not the form's own 60 s


def test_a_form_that_ends_after_the_break_is_superseded_without_exiting() -> None:
    superseded, exited = threading.Event(), threading.Event()

    def form() -> str:
        superseded.set()
        time.sleep(0.4)  # the break begins after the 0.25 s grace; the form ends before stuck_after
        return "engine"

    with pytest.raises(JoinSuperseded) as info:
        within_round(6, superseded.is_set, form, stuck_after=5.0, exit_process=exited.set)
    assert info.value.built == "engine" and not exited.is_set()
    assert within_round(7, lambda: False, lambda: "world", exit_process=exited.set) == "world"
    assert not exited.is_set()
