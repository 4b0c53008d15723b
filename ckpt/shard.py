"""What a rank hands to save and load: named tensors and the region of the global tensor each holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from stalwart.ckpt.errors import LayoutMismatch
from stalwart.ckpt.format import dtype_name
from stalwart.ckpt.layout import Region


@dataclass(frozen=True)
class Shard:
    """A rank's local ``tensor`` holding ``region`` of a global tensor.

    For a flat range the local tensor may have any shape; its elements are taken in row-major
    order. For a box the local tensor's shape must be the box's lengths. A plain tensor in a state
    mapping (instead of a ``Shard``) means *replicated*: every rank holds all of it, and exactly
    one rank (chosen by a hash of the name) writes it.
    """

    tensor: torch.Tensor
    region: Region

    @classmethod
    def full(cls, tensor: torch.Tensor) -> Shard:
        """The whole tensor, held by this rank alone (saved by this rank, whatever the world)."""
        return cls(tensor, Region.full(tensor.shape))

    @classmethod
    def flat(cls, tensor: torch.Tensor, global_shape: Sequence[int], start: int) -> Shard:
        """Elements ``[start, start + tensor.numel())`` of the flattened global tensor."""
        return cls(tensor, Region.flat_range(global_shape, start, start + tensor.numel()))

    @classmethod
    def box(cls, tensor: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int]) -> Shard:
        """The box of the global tensor starting at ``offsets`` with the local tensor's shape."""
        return cls(tensor, Region.box_at(global_shape, offsets, tensor.shape))


@dataclass(frozen=True)
class Entry:
    """One tensor a rank saves or loads, checked: name, local tensor, region, dtype name."""

    name: str
    tensor: torch.Tensor
    region: Region
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.tensor.element_size()


def replica_owner(name: str, world_size: int) -> int:
    """The rank that writes a replicated tensor: stable across processes and runs."""
    return xxhash.xxh32_intdigest(name.encode()) % world_size


def entries_for_save(state: Mapping[str, torch.Tensor | Shard], rank: int, world_size: int) -> list[Entry]:
    """The tensors this rank writes, sorted by name; raises :class:`LayoutMismatch` on bad input."""
    out = []
    for name, value in state.items():
        if not isinstance(value, Shard):
            if not isinstance(value, torch.Tensor):
                raise LayoutMismatch(f"{name!r}: expected a tensor or Shard, got {type(value).__name__}")
            if replica_owner(name, world_size) != rank:
                continue
            value = Shard.full(value)
        out.append(check_entry(name, value))
    return sorted(out, key=lambda e: e.name)


def host_copy(state: Mapping[str, torch.Tensor | Shard], rank: int,
              world_size: int) -> dict[str, tuple[Region, torch.Tensor]]:
    """What a save of ``state`` by ``rank`` would write, as 1-D host copies by name: an in-memory
    restore point laid out exactly as a checkpoint's part (so it reshards like one)."""
    out = {}
    for e in entries_for_save(state, rank, world_size):
        flat = e.tensor.detach().reshape(-1)
        out[e.name] = (e.region, torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat))
    return out


def entries_for_load(targets: Mapping[str, torch.Tensor | Shard]) -> list[Entry]:
    """Destinations of a load; a plain tensor asks for the whole tensor of its shape."""
    out = []
    for name, value in targets.items():
        if isinstance(value, torch.Tensor):
            value = Shard.full(value)
        if not isinstance(value, Shard):
            raise LayoutMismatch(f"{name!r}: expected a tensor or Shard, got {type(value).__name__}")
        out.append(check_entry(name, value))
    return sorted(out, key=lambda e: e.name)


def check_entry(name: str, shard: Shard) -> Entry:
    if not isinstance(name, str) or not name:
        raise LayoutMismatch(f"tensor names must be non-empty strings, got {name!r}")
    t = shard.tensor
    if t.layout != torch.strided or t.is_meta:
        raise LayoutMismatch(f"{name!r}: only dense tensors with storage can be checkpointed")
    shard.region.validate()
    if t.numel() != shard.region.numel:
        raise LayoutMismatch(f"{name!r}: local tensor has {t.numel()} elements, region {shard.region.numel}")
    if shard.region.box is not None and tuple(t.shape) != shard.region.box.lengths:
        raise LayoutMismatch(f"{name!r}: local shape {tuple(t.shape)} is not the box {shard.region.box.lengths}")
    return Entry(name, t, shard.region, dtype_name(t.dtype))
