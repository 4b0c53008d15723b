"""Helpers shared by the ckpt tests and their child processes: a threaded coordinator for simulating
many ranks in one process, deterministic tensors, and the layouts ranks hold them in."""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass

import torch

from stalwart.ckpt import Region, Shard, split_evenly
from stalwart.ckpt.errors import CommitFailed, CommitTimeout


class ThreadGroup:
    """N ranks as N threads of one process; ``coordinator(rank)`` is a ckpt Coordinator."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list[bytes | None] = [None] * world_size
        self._value: bytes | None = None

    def coordinator(self, rank: int) -> ThreadCoordinator:
        return ThreadCoordinator(self, rank)

    def _wait(self, timeout_s: float) -> None:
        try:
            self._barrier.wait(timeout_s)
        except threading.BrokenBarrierError as exc:
            raise CommitTimeout("a rank did not arrive") from exc


class ThreadCoordinator:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def gather(self, payload: bytes, timeout_s: float) -> list[bytes] | None:
        g = self.group
        g._slots[self.rank] = payload
        g._wait(timeout_s)
        out = [bytes(s) for s in g._slots if s is not None] if self.rank == 0 else None
        g._wait(timeout_s)
        if out is not None and len(out) != self.world_size:
            raise CommitFailed("missing payload")
        return out

    def broadcast(self, payload: bytes | None, timeout_s: float) -> bytes:
        g = self.group
        if self.rank == 0:
            g._value = payload
        g._wait(timeout_s)
        value = g._value
        g._wait(timeout_s)
        assert value is not None
        return value


def run_ranks(world_size: int, fn, timeout: float = 120.0) -> list:
    """Run ``fn(rank, coordinator)`` on ``world_size`` threads; return results, re-raise failures."""
    group = ThreadGroup(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group.coordinator(rank))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[rank] = exc
            group._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a simulated rank hangs")
    for exc in errors:
        if exc is not None and not isinstance(exc, CommitTimeout):
            raise exc
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


SPECS = [
    Spec("w32", (37, 53), torch.float32),
    Spec("bf", (1001,), torch.bfloat16),
    Spec("h16", (5, 7, 11), torch.float16),
    Spec("ids", (333, 3), torch.int64),
    Spec("bias", (13,), torch.float32),
    Spec("scalar", (), torch.float32),
    Spec("empty", (0, 4), torch.float32),
    Spec("f64", (9, 2), torch.float64),
]


def full_tensor(spec: Spec, step: int) -> torch.Tensor:
    """The global value of a tensor at a step: deterministic, different per name and step."""
    gen = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) * 1000 + step)
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, generator=gen, dtype=torch.float32).to(spec.dtype)
    return torch.randint(-(2**40), 2**40, spec.shape, generator=gen, dtype=spec.dtype)


def region_for(scheme: str, shape: tuple[int, ...], world: int, rank: int) -> Region | None:
    """The region a rank holds under a sharding scheme; ``None`` means replicated (plain tensor)."""
    if scheme == "replicated" or not shape:
        return None
    if scheme == "flat":
        return Region.flat_range(shape, *split_evenly(math.prod(shape), world, rank))
    dim = 0 if scheme == "rows" else len(shape) - 1
    lo, hi = split_evenly(shape[dim], world, rank)
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = lo, hi - lo
    return Region.box_at(shape, offsets, lengths)


def extract(full: torch.Tensor, region: Region) -> torch.Tensor:
    if region.flat is not None:
        return full.reshape(-1)[region.flat[0] : region.flat[1]].clone()
    assert region.box is not None
    index = tuple(slice(o, o + n) for o, n in zip(region.box.offsets, region.box.lengths, strict=True))
    return full[index].clone()


def rank_state(specs, schemes: dict[str, str], step: int, world: int, rank: int) -> dict:
    """What rank ``rank`` of ``world`` passes to ``Checkpointer.save`` at ``step``."""
    state: dict = {}
    for spec in specs:
        full = full_tensor(spec, step)
        region = region_for(schemes.get(spec.name, "flat"), spec.shape, world, rank)
        state[spec.name] = full if region is None else Shard(extract(full, region), region)
    return state


def rank_targets(specs, schemes: dict[str, str], world: int, rank: int) -> dict:
    """Empty destinations (filled with a sentinel) for a rank of the loading world."""
    targets: dict = {}
    for spec in specs:
        region = region_for(schemes.get(spec.name, "flat"), spec.shape, world, rank)
        if region is None:
            targets[spec.name] = torch.full(spec.shape, 7, dtype=spec.dtype)
        else:
            t = torch.full(region.local_shape, 7, dtype=spec.dtype)
            targets[spec.name] = Shard(t, region)
    return targets


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_targets(specs, targets: dict, step: int) -> list[str]:
    """Names whose loaded values are not bitwise what was saved at ``step``."""
    bad = []
    for spec in specs:
        value = targets[spec.name]
        expected = full_tensor(spec, step)
        if isinstance(value, Shard):
            got, want = value.tensor, extract(expected, value.region)
        else:
            got, want = value, expected
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(bits(got), bits(want)):
            bad.append(spec.name)
    return bad
