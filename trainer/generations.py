"""Memory generations: restore points kept in host memory between checkpoints.

Why: a restore from storage goes back to the last commit, and every step since is computed again
(with a commit every 10 steps, 5 on average). A memory generation is every rank's part of one
step, laid out as a checkpoint's (so it reshards like one) and with the same metadata, taken
every ``PeerConfig.memory_every`` steps between saves: kept by the rank that took it and pushed to
its buddies (``trainer/peer.py``), never written to disk. A restore that finds a complete
generation newer than the last commit takes it, and redoes at most ``memory_every - 1`` steps.

Safety: parts of two different trajectories must never be combined. Every restore (from memory,
from storage, or a rollback) starts a new *lineage*: a random tag chosen by rank 0 and known to
every rank of the world. Parts carry the tag they were taken under; a store keeps and accepts
only parts of its current lineage and drops the rest when a restore starts a new one. A restore
takes a generation only when every rank that knows a lineage knows the same one, and only when
parts of every rank that took it are alive (its own, held by a buddy, or both), and the whole
world agrees that each rank could fill all of its targets: otherwise every rank reads storage.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.ckpt import Shard, decode_metadata
from stalwart.trainer.peer_fill import PeerFill, fill_from_parts, useful
from stalwart.trainer.peer_wire import Part

__all__ = ["Generation", "MemoryRestore", "MemoryStore", "choose_generation", "fill_generation",
           "restore_from_memory"]

log = logging.getLogger(__name__)
KEEP = 2  # generations kept per origin: the newest one may still be on its way to a buddy


@dataclass(frozen=True)
class Generation:
    """One memory generation: the lineage it belongs to, its step, the world that took it."""

    tag: str
    step: int
    world: int


@dataclass
class MemoryRestore:
    """What a restore from memory found: the generation, where its bytes came from (own part,
    parts held for others, parts pulled) and the metadata this rank applies."""

    generation: Generation
    fill: PeerFill
    trainer_meta: dict[str, Any]
    rng: dict[str, Any] | None  # this rank's saved RNG streams (None: the world grew past it)


class MemoryStore:
    """This process's memory generations of one lineage: its own parts and the copies it holds
    for other ranks, the newest :data:`KEEP` of each origin above the last committed step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lineage = ""
        self._committed = -1
        self._own: dict[int, Part] = {}  # step -> this process's part
        self._held: dict[int, dict[int, Part]] = {}  # origin rank -> step -> its part

    def reset(self, lineage: str) -> None:
        """A restore started ``lineage``: every part of an older one is dropped. The commit floor
        goes too (a restore may have set aside a newer, corrupt step: its number is free again)."""
        with self._lock:
            self.lineage = lineage
            self._committed = -1
            self._own.clear()
            self._held.clear()

    def committed(self, step: int) -> None:
        """``step`` is committed to storage: generations at or before it are of no more use."""
        with self._lock:
            self._committed = max(self._committed, step)
            self._prune()

    def keep_own(self, part: Part) -> bool:
        with self._lock:
            if part.tag != self.lineage or not part.tag or part.step <= self._committed:
                return False
            self._own[part.step] = part
            self._prune()
            return True

    def accept(self, part: Part) -> str | None:
        """Hold a buddy's part; returns why it was refused, or ``None``."""
        with self._lock:
            if not self.lineage or part.tag != self.lineage:
                return f"lineage {part.tag[:8]!r} is not this rank's ({self.lineage[:8]!r})"
            if part.step <= self._committed:
                return f"stale: step {self._committed} is committed already"
            self._held.setdefault(part.rank, {})[part.step] = part
            self._prune()
            return None

    def get(self, tag: str, step: int, origin: int) -> Part | None:
        with self._lock:
            if tag != self.lineage:
                return None
            own = self._own.get(step)
            if own is not None and own.rank == origin:
                return own
            return self._held.get(origin, {}).get(step)

    def parts(self, tag: str, step: int) -> tuple[Part | None, list[Part]]:
        """(this process's own part, the parts it holds for others) of one generation."""
        with self._lock:
            if tag != self.lineage:
                return None, []
            held = [by_step[step] for by_step in self._held.values() if step in by_step]
            return self._own.get(step), held

    def report(self) -> dict[str, Any]:
        """What a restore's all-gather says of this store: its lineage and each part's summary."""
        with self._lock:
            parts = [*self._own.values(), *(p for by_step in self._held.values() for p in by_step.values())]
            return {"lineage": self.lineage, "parts": [p.summary() for p in parts]}

    def freed_by(self, origin: int) -> int:
        """Bytes a new part of ``origin`` frees: its oldest part, when it has :data:`KEEP` already."""
        with self._lock:
            steps = self._held.get(origin, {})
            return steps[min(steps)].nbytes if len(steps) >= KEEP else 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for by_step in self._held.values() for p in by_step.values())

    def _prune(self) -> None:
        self._own = {s: p for s, p in self._own.items() if s > self._committed}
        for s in sorted(self._own)[:-KEEP]:
            del self._own[s]
        for origin in list(self._held):
            steps = {s: p for s, p in self._held[origin].items() if s > self._committed}
            for s in sorted(steps)[:-KEEP]:
                del steps[s]
            if steps:
                self._held[origin] = steps
            else:
                del self._held[origin]


def choose_generation(reports: Sequence[dict[str, Any]], newer_than: int, at_most: int | None = None
                      ) -> Generation | None:
    """The newest generation above step ``newer_than`` (and at or below ``at_most``: a rollback's
    cap) with a part of every rank that took it, from every rank's :meth:`MemoryStore.report`.
    The same on every rank (a pure function of the all-gathered reports). ``None`` when ranks
    know different lineages: then nothing in memory can be trusted to be of one trajectory."""
    lineages = {str(r["lineage"]) for r in reports if r["lineage"]}
    if len(lineages) != 1:
        if len(lineages) > 1:
            log.warning("memory generations of %d lineages in one world: none is used", len(lineages))
        return None
    (lineage,) = lineages
    worlds: dict[int, set[int]] = {}
    origins: dict[int, set[int]] = {}
    cap = math.inf if at_most is None else at_most
    for r in reports:
        for s in r["parts"]:
            step = int(s["step"])
            if s["tag"] == lineage and newer_than < step <= cap:
                worlds.setdefault(step, set()).add(int(s["world"]))
                origins.setdefault(step, set()).add(int(s["rank"]))
    for step in sorted(origins, reverse=True):
        if len(worlds[step]) == 1:
            (world,) = worlds[step]
            if world > 0 and origins[step] == set(range(world)):
                return Generation(lineage, step, world)
    return None


Pull = Callable[[int, int, Generation, list[str] | None], Part]  # holder, origin, generation, names (None: meta)


def fill_generation(store: MemoryStore, pull: Pull, gen: Generation, reports: Sequence[dict[str, Any]], rank: int,
                    targets: dict[str, torch.Tensor | Shard]) -> tuple[dict[str, torch.Tensor | Shard],
                                                                       MemoryRestore | None]:
    """Fill ``targets`` from generation ``gen``: this process's parts, then parts pulled from the
    lowest-ranked holder of each other origin (in parallel). Returns what is left unfilled and,
    when nothing is and the metadata this rank needs was found, what the restore applies."""
    own, held = store.parts(gen.tag, gen.step)
    local = [*([own] if own is not None else []), *held]
    local_origins = {p.rank for p in local}
    holder: dict[int, tuple[int, dict[str, Any]]] = {}
    for r, report in enumerate(reports):
        for s in report["parts"]:
            key = (s["tag"], int(s["step"]), int(s["rank"]))
            if key[:2] == (gen.tag, gen.step) and key[2] not in local_origins and key[2] not in holder:
                holder[key[2]] = (r, s)
    wanted: dict[int, list[str] | None] = {o: names for o, (_, s) in holder.items() if (names := useful(s, targets))}
    # The metadata: the trainer's from rank 0's part (as a storage restore reads it), RNG from this rank's.
    for origin in {0, rank} & set(range(gen.world)):
        if origin not in local_origins and origin not in wanted and origin in holder:
            wanted[origin] = None

    def fetch(origin: int) -> Part | None:
        try:
            return pull(holder[origin][0], origin, gen, wanted[origin])
        except Exception as exc:  # noqa: BLE001 - any failure is a part not had: the world reads storage
            log.warning("rank %d: cannot pull rank %d's memory part of step %d from rank %d: %s", rank, origin,
                        gen.step, holder[origin][0], exc)
            return None

    pulled: list[Part] = []
    if wanted:
        with ThreadPoolExecutor(max_workers=min(8, len(wanted)), thread_name_prefix="stalwart-memory-pull") as ex:
            pulled = [p for p in ex.map(fetch, sorted(wanted)) if p is not None]
    rest, copied = fill_from_parts(targets, [*local, *pulled])
    metas = {p.rank: p.meta for p in [*local, *pulled] if p.meta is not None}
    if rest or 0 not in metas or (rank < gen.world and rank not in metas):
        return rest, None
    own_rank = own.rank if own is not None else None
    try:
        trainer_meta = dict(decode_metadata(metas[0])["trainer"])
        rng = dict(decode_metadata(metas[rank])["rng"]) if rank < gen.world else None
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("rank %d: memory generation of step %d: malformed metadata (%s)", rank, gen.step, exc)
        return rest, None
    fill = PeerFill.of(copied, own_rank, local_origins, {o: h for o, (h, _) in holder.items()})
    return rest, MemoryRestore(gen, fill, trainer_meta, rng)


def restore_from_memory(store: MemoryStore, pull: Pull, targets: dict[str, torch.Tensor | Shard],
                        newer_than: int, group: Any, rank: int, world_size: int,
                        at_most: int | None = None) -> MemoryRestore | None:
    """Fill ``targets`` from the newest complete generation above step ``newer_than`` (at or
    below ``at_most``), or return ``None`` on every rank alike (then the caller reads storage;
    what was filled is overwritten). Collective on ``group``."""
    import torch.distributed as dist

    reports: list[Any] = [None] * world_size
    dist.all_gather_object(reports, store.report(), group=group)
    gen = choose_generation(reports, newer_than, at_most)
    if gen is None:
        return None
    rest, result = fill_generation(store, pull, gen, reports, rank, targets)
    complete = torch.tensor([int(result is not None)], dtype=torch.int64)
    dist.all_reduce(complete, op=dist.ReduceOp.MIN, group=group)
    if not int(complete.item()):
        if result is None:
            log.warning("rank %d: memory generation of step %d incomplete here (%d tensor(s) unfilled, or its "
                        "metadata missing): the world restores from storage", rank, gen.step, len(rest))
        return None
    return result
