"""Filling a restore's targets from parts held in memory (pure: no sockets, no collectives).

Shared by the restore from a committed step's buddy replicas (``trainer/peer.py``) and from a
memory generation (``trainer/generations.py``): both hold parts laid out as a checkpoint's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.ckpt import Region, Shard
from stalwart.trainer.peer_wire import Part

__all__ = ["PeerFill", "fill_from_parts", "useful"]


@dataclass
class PeerFill:
    """What a restore took from memory: bytes from this process's own copy, from copies it held
    for other ranks, and pulled from peers; the parts pulled (origin rank -> holder rank)."""

    own_bytes: int = 0
    held_bytes: int = 0
    pulled_bytes: int = 0
    pulled: dict[int, int] = field(default_factory=dict)

    @property
    def memory_bytes(self) -> int:
        return self.own_bytes + self.held_bytes + self.pulled_bytes

    @classmethod
    def of(cls, copied: Mapping[int, int], own_rank: int | None, local_origins: Collection[int],
           holder: Mapping[int, int]) -> PeerFill:
        """Split the bytes :func:`fill_from_parts` copied per origin rank by where each part came
        from: this process's own, a copy it held, or pulled from ``holder[origin]``."""
        fill = cls()
        for origin, n in copied.items():
            if origin == own_rank:
                fill.own_bytes += n
            elif origin in local_origins:
                fill.held_bytes += n
            else:
                fill.pulled_bytes += n
                fill.pulled[origin] = holder[origin]
        return fill


def fill_from_parts(targets: dict[str, torch.Tensor | Shard],
                    parts: Sequence[Part]) -> tuple[dict[str, torch.Tensor | Shard], dict[int, int]]:
    """Copy into ``targets`` what ``parts`` (of one step) hold; returns the targets still to read
    from storage and the bytes copied per origin rank.

    Parts are applied in rank order, so a flat range spanning several ranks' partitions is
    covered from its start on (the loader takes one region per name: a range covered only in its
    middle stays whole for storage). Bitwise what the loader would have read: each part is what
    its rank wrote.
    """
    rest = dict(targets)
    copied: dict[int, int] = {}
    for part in sorted(parts, key=lambda p: p.rank):
        n = 0
        for name, (region, data) in part.tensors.items():
            target = rest.get(name)
            if target is None:
                continue
            left, got = _fill_one(target, region, data)
            n += got
            if left is None:
                del rest[name]
            else:
                rest[name] = left
        if n:
            copied[part.rank] = copied.get(part.rank, 0) + n
    return rest, copied


def _fill_one(target: torch.Tensor | Shard, region: Region,
              data: torch.Tensor) -> tuple[torch.Tensor | Shard | None, int]:
    """Fill ``target`` from one held region: (what is left of it, or None; bytes copied). A
    target on a GPU is copied into from the host part directly (a memory generation's restore
    must fill every target, not leave the device ones to storage)."""
    if isinstance(target, Shard):
        t, tr = target.tensor, target.region
        if (tr.flat is None or region.flat is None or tuple(tr.shape) != tuple(region.shape)
                or data.dtype != t.dtype or not t.is_contiguous()):
            return target, 0
        (a, b), (c, d) = tr.flat, region.flat
        i, j = max(a, c), min(b, d)
        if i >= j or (i > a and j < b):
            return target, 0
        flat = t.view(-1)
        flat[i - a : j - a].copy_(data[i - c : j - c])
        copied = (j - i) * t.element_size()
        if i > a:
            return Shard.flat(flat[: i - a], tr.shape, a), copied
        if j < b:
            return Shard.flat(flat[j - a :], tr.shape, j), copied
        return None, copied
    if (region.box is not None and tuple(region.shape) == tuple(target.shape) and region.numel == target.numel()
            and data.dtype == target.dtype and target.is_contiguous()):
        target.view(-1).copy_(data)  # a replicated tensor that rank wrote whole
        return None, target.numel() * target.element_size()
    return target, 0


def useful(summary: dict[str, Any], targets: dict[str, torch.Tensor | Shard]) -> list[str]:
    """The names of a part (its summary) that overlap what is still to fill."""
    names = []
    for name, reg in summary["tensors"].items():
        target = targets.get(name)
        if target is None:
            continue
        if isinstance(target, Shard):
            flat = target.region.flat
            if flat is not None and "flat" in reg and list(target.region.shape) == reg["shape"]:
                c, d = reg["flat"]
                if max(flat[0], c) < min(flat[1], d):
                    names.append(name)
        elif "lengths" in reg and list(target.shape) == reg["shape"] == reg["lengths"]:
            names.append(name)
    return names
