"""Commit coordination: how ranks tell rank 0 their shard is durable, and learn the outcome.

The protocol needs two operations, both with a deadline, called by every rank in the same order:

1. ``gather(payload)`` — rank 0 receives every rank's bytes, in rank order; others get ``None``.
2. ``broadcast(payload)`` — every rank receives rank 0's bytes.

:class:`TorchDistCoordinator` does this over a dedicated gloo group (so the background persist
thread never interleaves with the training's own collectives); :class:`CallbackCoordinator` wraps
two functions of yours (an etcd barrier, a file-system rendezvous); :class:`SingleCoordinator` is a
world of one. Payloads are bytes (JSON); no object is ever pickled.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from stalwart.ckpt.errors import CommitFailed, CommitTimeout


@runtime_checkable
class Coordinator(Protocol):
    """What the saver and loader need from the ranks of one world. See the module docstring.

    Implementations raise :class:`CommitTimeout` when the deadline passes and
    :class:`CommitFailed` for any other failure. A coordinator is used by one thread at a time.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def gather(self, payload: bytes, timeout_s: float) -> list[bytes] | None: ...

    def broadcast(self, payload: bytes | None, timeout_s: float) -> bytes: ...


class SingleCoordinator:
    """A world of one rank: gather and broadcast return what they are given."""

    rank = 0
    world_size = 1

    def gather(self, payload: bytes, timeout_s: float) -> list[bytes] | None:
        return [payload]

    def broadcast(self, payload: bytes | None, timeout_s: float) -> bytes:
        if payload is None:
            raise CommitFailed("rank 0 must broadcast a payload")
        return payload


class CallbackCoordinator:
    """Coordination through two callables you provide (e.g. a barrier on etcd).

    ``gather(rank, payload, timeout_s)`` must return the list of all payloads on rank 0 and
    ``None`` elsewhere; ``broadcast(rank, payload, timeout_s)`` must return rank 0's payload on
    every rank. Exceptions they raise become :class:`CommitFailed` (``TimeoutError`` becomes
    :class:`CommitTimeout`).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        gather: Callable[[int, bytes, float], list[bytes] | None],
        broadcast: Callable[[int, bytes | None, float], bytes],
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self._rank, self._world_size = rank, world_size
        self._gather, self._broadcast = gather, broadcast

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def gather(self, payload: bytes, timeout_s: float) -> list[bytes] | None:
        with _translated("gather"):
            out = self._gather(self._rank, payload, timeout_s)
        if self._rank == 0 and (out is None or len(out) != self._world_size):
            raise CommitFailed(f"gather returned {0 if out is None else len(out)} payloads for {self._world_size}")
        return out

    def broadcast(self, payload: bytes | None, timeout_s: float) -> bytes:
        with _translated("broadcast"):
            return self._broadcast(self._rank, payload, timeout_s)


class TorchDistCoordinator:
    """Coordination over torch.distributed, on a gloo group of its own.

    Construct it on every rank at the same point of the program (creating a group is itself a
    collective), after ``init_process_group``. The group's timeout is ``timeout_s``; gloo keeps one
    timeout per group, so the per-call deadline cannot be shorter than that.
    """

    def __init__(self, timeout_s: float = 600.0, group: object | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CommitFailed("torch.distributed has no initialized process group")
        self._dist = dist
        if group is None:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def gather(self, payload: bytes, timeout_s: float) -> list[bytes] | None:
        dist = self._dist
        with _translated("gather"):
            size = torch.tensor([len(payload)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
            dist.all_gather(sizes, size, group=self._group)
            longest = max(int(s.item()) for s in sizes)
            buf = torch.zeros(longest, dtype=torch.uint8)
            if payload:
                buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self._rank == 0:
                bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._world_size)]
                dist.gather(buf, bufs, group=self._group, group_dst=0)
                return [bytes(b[: int(s.item())].numpy()) for b, s in zip(bufs, sizes, strict=True)]
            dist.gather(buf, None, group=self._group, group_dst=0)
            return None

    def broadcast(self, payload: bytes | None, timeout_s: float) -> bytes:
        dist = self._dist
        with _translated("broadcast"):
            size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
            dist.broadcast(size, group=self._group, group_src=0)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if self._rank == 0 and payload:
                buf[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(buf, group=self._group, group_src=0)
            return bytes(buf.numpy())


def default_coordinator(timeout_s: float = 600.0) -> Coordinator:
    """torch.distributed when a process group is initialized, else a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return TorchDistCoordinator(timeout_s)
    return SingleCoordinator()


class _translated:
    """Turn any failure of a coordination call into CommitFailed / CommitTimeout."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or isinstance(exc, CommitFailed) or not isinstance(exc, Exception):
            return False
        text = str(exc).lower()
        if isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text:
            raise CommitTimeout(f"{self.what} did not finish in time: {exc}") from exc
        raise CommitFailed(f"{self.what} failed: {exc}") from exc
