"""Seconds a training process spends blocked in ``torch.distributed`` collectives.

Why: in synchronous data parallelism every rank's wall step time is the same — fast ranks wait
for the slow one inside the collectives — so a straggler can only be told apart by its *busy*
time, wall time minus time blocked in collectives. :func:`install` wraps the collective functions
of the ``torch.distributed`` module in place. DeepSpeed's ``TorchBackend``
(``deepspeed/comm/torch.py``) calls most of them as ``torch.distributed.<name>(...)``, an attribute
lookup at call time, so the wrappers see them without any change to the trainer. Three exceptions,
handled here: it reaches ``_all_gather_base`` and, in ``all_gather_coalesced``,
``all_gather_into_tensor`` through ``torch.distributed.distributed_c10d`` (so that module's names
are wrapped too), and its ``TorchBackend`` captures ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` once, when ``deepspeed.init_distributed`` runs (the ZeRO all-gather and
reduce-scatter), so :func:`install` refreshes those two on an existing backend. Point-to-point
calls (send/recv) are not collectives and are not counted. ``tests/agent/test_collective_timer.py``
checks all this with a DeepSpeed ZeRO engine.

``async_op=True``: the returned ``Work`` is wrapped in a proxy whose ``wait()`` is timed (every
other attribute is the real ``Work``'s), so the time counted is the time the caller actually
waited. Gap: a ``Work`` that is never waited on but completed through ``get_future()`` or that is
passed to C++ code as is counts only the (short) time of issuing it.

Nested calls (a wrapped collective that calls another) count once, on the outermost call.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

COLLECTIVES = (
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "reduce", "all_gather",
    "barrier", "reduce_scatter", "all_to_all_single", "all_to_all", "gather", "scatter",
    "all_reduce_coalesced", "all_gather_coalesced", "monitored_barrier", "_all_gather_base",
    "_reduce_scatter_base", "broadcast_object_list", "all_gather_object", "_all_gather_base_coalesced",
)


class CollectiveTimer:
    """Accumulates blocked seconds; :meth:`take` reads and resets them (one reading per step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocked = 0.0
        self._calls = 0
        self._local = threading.local()
        self.by_name: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._blocked += seconds
            self._calls += 1
            self.by_name[name] = self.by_name.get(name, 0) + 1

    def take(self) -> float:
        with self._lock:
            blocked, self._blocked = self._blocked, 0.0
        return blocked

    @property
    def calls(self) -> int:
        return self._calls

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth:
                return fn(*args, **kwargs)
            self._local.depth = 1
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._local.depth = 0
                self.add(name, time.perf_counter() - start)
            if kwargs.get("async_op") and result is not None:
                return _TimedWork(result, self, name)
            return result

        timed.__stalwart_timed__ = fn  # type: ignore[attr-defined]
        return timed


class _TimedWork:
    """A ``Work`` whose ``wait()`` counts as blocked time; everything else is the real one's."""

    def __init__(self, work: Any, timer: CollectiveTimer, name: str) -> None:
        self._work = work
        self._timer = timer
        self._name = name

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer.add(self._name + ".wait", time.perf_counter() - start)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._work, attr)


_installed: CollectiveTimer | None = None
_install_lock = threading.Lock()


def install() -> CollectiveTimer:
    """Wrap the collectives of ``torch.distributed`` (once per process) and return the timer."""
    global _installed
    with _install_lock:
        if _installed is not None:
            return _installed
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        timer = CollectiveTimer()
        wrapped: dict[int, Callable[..., Any]] = {}  # one wrapper per function, whichever module names it
        for module in (dist, distributed_c10d):
            for name in COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is None or hasattr(fn, "__stalwart_timed__"):
                    continue
                if id(fn) not in wrapped:
                    wrapped[id(fn)] = timer.wrap(name, fn)
                setattr(module, name, wrapped[id(fn)])
        _refresh_deepspeed_backend()
        _installed = timer
        return timer


def _refresh_deepspeed_backend() -> None:
    """DeepSpeed's TorchBackend keeps the all-gather/reduce-scatter functions it found at
    ``init_distributed``; make it look them up again (now wrapped)."""
    comm = sys.modules.get("deepspeed.comm.comm")
    cdb = getattr(comm, "cdb", None) if comm is not None else None
    if cdb is None:
        return
    for attr, getter in (("all_gather_function", "get_all_gather_function"),
                         ("reduce_scatter_function", "get_reduce_scatter_function")):
        if hasattr(cdb, attr) and hasattr(cdb, getter):
            setattr(cdb, attr, getattr(cdb, getter)())


def uninstall() -> None:
    """Restore the original functions (tests)."""
    global _installed
    with _install_lock:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for module in (dist, distributed_c10d):
            for name in COLLECTIVES:
                original = getattr(getattr(module, name, None), "__stalwart_timed__", None)
                if original is not None:
                    setattr(module, name, original)
        _refresh_deepspeed_backend()
        _installed = None


def installed() -> CollectiveTimer | None:
    return _installed
