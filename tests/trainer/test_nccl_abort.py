"""NCCL's abort path, its decision only: no GPU here, so the abort itself is a recorded call.

A Reform that finds the rank still in the old world after ``nccl_abort_after_s`` means its main
thread is stuck in a collective on a lost peer: every group is aborted. A rank that began to
leave in time is left alone.
"""

from __future__ import annotations

import threading
import time

from stalwart.trainer import Trainer, TrainerConfig


def _trainer(after: float | None) -> Trainer:
    t = Trainer.__new__(Trainer)  # the decision needs no world
    t.config = TrainerConfig(checkpoint_dir="unused", global_batch=2, micro_batch=1, dataset_len=2,
                             nccl_abort_after_s=after)
    t._reform_lock, t._left_world, t._leaves, t._last_step_time = threading.Lock(), threading.Event(), 0, 0.0
    t.rank = t.round = t.step = 0
    return t


def test_a_rank_still_in_the_old_world_aborts_its_groups() -> None:
    t, calls = _trainer(0.05), []
    assert t._abort_if_stuck(0, lambda: calls.append("abort")) and calls == ["abort"]


def test_a_rank_that_began_to_leave_in_time_does_not_abort() -> None:
    t, calls = _trainer(5.0), []

    def leave() -> None:
        time.sleep(0.05)
        with t._reform_lock:
            t._leaves += 1
        t._left_world.set()

    threading.Thread(target=leave).start()
    started = time.monotonic()
    assert not t._abort_if_stuck(0, lambda: calls.append("abort")) and calls == []
    assert time.monotonic() - started < 4.0  # it stopped waiting when the rank left


def test_the_default_wait_follows_the_step_time() -> None:
    t, calls = _trainer(None), []
    t._last_step_time = 0.01  # 3 x 0.01 s is under the 5 s floor
    t._left_world.set()  # a leave seen, but the count unchanged: still stuck
    assert t._abort_if_stuck(0, lambda: calls.append("abort")) and calls == ["abort"]
