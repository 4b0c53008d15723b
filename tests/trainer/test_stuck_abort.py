"""The stuck-step abort, its decision only: the abort itself is a recorded call (the real one,
gloo's cut and NCCL's group abort, is exercised by ``test_reform.py``'s SIGSTOP survivors).

A Reform that finds the rank in a step that has run ``abort_stuck_after_s`` means its main thread
is stuck in a collective on a lost peer: the old world is aborted. A rank that begins to leave in
time, or is already re-forming, is left alone. One still stuck after the abort exits (a recorded
call here; ``test_stuck_send.py`` runs the real one against a real stuck gloo send).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from stuck_watch import watch_shell

from stalwart.trainer import Trainer

_trainer = watch_shell  # the decision needs no world


def _leave_soon(t: Trainer, after: float = 0.05) -> None:
    """The main thread begins to leave its world ``after`` seconds from now."""
    def leave() -> None:
        time.sleep(after)
        with t._reform_lock:
            t._leaves += 1
        t._left_world.set()

    threading.Thread(target=leave).start()


def _aborts(t: Trainer, calls: list[str]) -> Callable[[], None]:
    """An abort that makes the stuck collective raise: the main thread then begins to leave."""
    def abort() -> None:
        calls.append("abort")
        _leave_soon(t, 0.0)

    return abort


def test_a_rank_stuck_in_its_step_aborts_the_old_world() -> None:
    t, calls = _trainer(0.05), []
    assert t._abort_if_stuck(0, _aborts(t, calls), 1, lambda: calls.append("exit"))
    assert calls == ["abort"]


def _in_one_collective(t: Trainer) -> None:
    """The training thread stays in one collective call (the same frame at the same instruction)."""
    call = (object(), 7)
    t._collective_call = lambda: call  # type: ignore[method-assign]


def test_a_rank_still_stuck_in_a_collective_after_the_abort_exits() -> None:
    """A collective the abort cannot interrupt (gloo: a send partly written to a stopped peer)."""
    t, calls = _trainer(0.05), []
    _in_one_collective(t)
    assert t._abort_if_stuck(0, lambda: calls.append("abort"), 1, lambda: calls.append("exit"))
    assert calls == ["abort", "exit"]


def test_a_rank_slow_in_a_long_call_of_its_own_after_the_abort_does_not_exit() -> None:
    """Not in a collective (an optimizer step on the CPU, a large copy): its next collective raises
    on the cut world, so it leaves then; exiting would cost a spare for nothing."""
    t, calls = _trainer(0.05), []
    t._collective_call = lambda: None  # type: ignore[method-assign]
    assert t._abort_if_stuck(0, lambda: calls.append("abort"), 1, lambda: calls.append("exit"))
    assert calls == ["abort"]
    t, calls = _trainer(0.05), []
    calls_seen = iter([(object(), 1), (object(), 1)])  # a collective, then another: it moves on
    t._collective_call = lambda: next(calls_seen)  # type: ignore[method-assign]
    assert t._abort_if_stuck(0, lambda: calls.append("abort"), 1, lambda: calls.append("exit"))
    assert calls == ["abort"]


def test_a_thread_outside_torch_distributed_is_not_taken_to_be_in_a_collective() -> None:
    from stalwart.trainer.reforming import _call_in_collective

    here = threading.get_ident()
    assert _call_in_collective(here) is None  # this test's own code
    assert _call_in_collective(None) is None


def test_a_step_already_past_the_limit_when_the_reform_comes_aborts_at_once() -> None:
    t, calls = _trainer(3600.0, step_began=7200.0), []  # stuck for two hours already: no wait
    assert t._abort_if_stuck(0, _aborts(t, calls), 1, lambda: calls.append("exit"))
    assert calls == ["abort"]


def test_a_rank_that_began_to_leave_in_time_does_not_abort() -> None:
    t, calls = _trainer(3600.0), []
    _leave_soon(t)
    assert not t._abort_if_stuck(0, lambda: calls.append("abort"), 1) and calls == []  # returned: it left


def test_a_rank_already_reforming_is_left_to_its_join() -> None:
    t, calls = _trainer(0.01, step_began=1.0), []
    t._reforming = True  # the Reform came while it joins an earlier round: the join gives way itself
    assert not t._abort_if_stuck(0, lambda: calls.append("abort"), 1) and calls == []


def test_a_rank_that_reached_the_reforms_round_within_its_leave_does_not_abort() -> None:
    """The Reform to round 2 came while the rank joined round 1; the join gave way and the rank
    re-formed into round 2 without leaving again, just before the limit: the world it is in now
    is round 2's, which must not be cut."""
    t, calls = _trainer(0.01, step_began=1.0), []
    t.round = 2
    assert not t._abort_if_stuck(0, lambda: calls.append("abort"), 2) and calls == []
    t.round = 1  # still in the world before the Reform's round: stuck there
    _in_one_collective(t)
    assert t._abort_if_stuck(0, lambda: calls.append("abort"), 2, lambda: calls.append("exit"))
    assert calls == ["abort", "exit"]


def test_the_default_limit_follows_the_step_time() -> None:
    t, calls = _trainer(None, step_began=1.5), []
    t._last_step_time = 0.01  # 3 x 0.01 s is under the 0.5 s floor, which the step is past
    assert t._abort_if_stuck(0, _aborts(t, calls), 1, lambda: calls.append("exit"))
    assert calls == ["abort"]
    t, calls = _trainer(None, step_began=1.5), []
    t._last_step_time = 3600.0  # a step this slow is not stuck at 1.5 s
    _leave_soon(t)
    assert not t._abort_if_stuck(0, lambda: calls.append("abort"), 1) and calls == []
