"""A :class:`~stalwart.trainer.Trainer` with only the state its stuck-step watch reads (no world,
no engine), for the watch's tests and ``stuck_send_child.py``. Importable without the test
folder's other helpers, so the child can run as a plain script."""

from __future__ import annotations

import threading
import time

from stalwart.trainer import Trainer, TrainerConfig


def watch_shell(after: float | None, *, step_began: float = 0.0) -> Trainer:
    """A trainer whose current step began ``step_began`` seconds ago, with ``abort_stuck_after_s = after``."""
    t = Trainer.__new__(Trainer)
    t.config = TrainerConfig(checkpoint_dir="unused", global_batch=2, micro_batch=1, dataset_len=2,
                             abort_stuck_after_s=after)
    t._reform_lock, t._left_world, t._leaves, t._last_step_time = threading.Lock(), threading.Event(), 0, 0.0
    t._reforming = False
    t._step_started = time.perf_counter() - step_began
    t.rank = t.round = t.step = 0
    return t
