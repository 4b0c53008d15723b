"""Restoring a checkpoint into the engine, and the trainer's part of each checkpoint.

:class:`RestoreMixin` is the part of :class:`~stalwart.trainer.Trainer` that loads the newest
good checkpoint resharded to the current world (at start, after a re-form, or to roll back), from
the process's own host copy and peers' replicas first and from storage for the rest (or, newer
than any checkpoint, a memory generation: ``generations.py``), and refuses
one that does not fit the model or the data order. The trainer metadata and RNG streams a save
writes are defined here beside the code that reads them back.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.ckpt import (
    CheckpointError,
    CheckpointNotFound,
    CommittedSnapshot,
    LayoutMismatch,
    list_checkpoints,
    load,
    read_manifest,
    set_aside,
)
from stalwart.trainer.batching import DataPosition
from stalwart.trainer.config import RestoreInfo
from stalwart.trainer.errors import IncompatibleCheckpoint, ReformFailed
from stalwart.trainer.generations import restore_from_memory
from stalwart.trainer.health import HealthMonitor, RollbackLedger, read_journal
from stalwart.trainer.peer import Part, PeerFill, fill_from_parts

log = logging.getLogger(__name__)
FORMAT = 1


class RestoreMixin:
    """Mixed into :class:`~stalwart.trainer.Trainer`: works on its world, engine state and counters."""

    def _trainer_meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "format": FORMAT, "step": self.step, "world_size": self.world_size, "global_batch": c.global_batch,
            "micro_batch": c.micro_batch, "dataset_len": c.dataset_len, "seed": c.seed, "shuffle": c.shuffle,
            "position": self.sampler.position.to_json(), "zero": self.state.metadata(),
            "health": {"history": self.health.to_json(), "rollbacks": self.ledger.to_json()},
        }  # fmt: skip

    def _restore(self, max_step: int | None = None, *, rollback: bool = False, required: bool = False,
                 host: CommittedSnapshot | None = None) -> RestoreInfo | None:
        """Load the newest good checkpoint (at or below ``max_step``) into the engine.

        At start no checkpoint means a fresh start at step 0; for a ``rollback`` it means
        ``None``; where one is ``required`` (a re-form or a spare: the model's weights are no
        longer the initial ones) it raises :class:`ReformFailed`. Rollbacks recorded in the
        journal are merged with the checkpoint's.

        ``host``: this process's host copy of its part of the last committed save (a re-form).
        Where it is the newest committed step, the parts of this rank's new partition it holds
        are copied from it and only the rest is read from disk. Should the loader fall back to
        an older step (the newest one is corrupt somewhere), every rank loads that step again
        from disk alone, so no rank mixes two steps.

        With peer replicas, a complete memory generation newer than the newest commit (and at or
        below ``max_step``; ``trainer/generations.py``) is taken first: a rollback then redoes at
        most ``memory_every - 1`` steps, not every step since the last commit. Generations are
        taken of healthy steps only, so one below the fault is as clean as a checkpoint there.
        Every restore that succeeds starts a new lineage of memory generations (rank 0 picks its
        tag).
        """
        root = self.config.checkpoint_dir
        if self.rank == 0:
            steps = [c.step for c in list_checkpoints(root)
                     if c.committed and (max_step is None or c.step <= max_step)]  # fmt: skip
            found = {"any": bool(steps), "journal": read_journal(root) if steps and not rollback else [],
                     "newest": max(steps) if steps else None, "lineage": secrets.token_hex(8)}
            self._coord.broadcast(json.dumps(found).encode(), self.config.commit_timeout_s)
        else:
            found = json.loads(self._coord.broadcast(None, self.config.commit_timeout_s))
        restored = None
        if self.peers is not None and (self.config.peer.memory_every > 0 or not rollback):
            restored = self._restore_from_memory(found, max_step, rollback=rollback)
        if restored is None:
            restored = self._restore_from_storage(found, max_step, rollback=rollback, required=required, host=host)
        if self.peers is not None and restored is not None:
            self.peers.memory.reset(str(found["lineage"]))  # what memory holds is of another trajectory now
        return restored

    def _restore_from_memory(self, found: dict[str, Any], max_step: int | None, *, rollback: bool
                             ) -> RestoreInfo | None:
        """The newest complete memory generation above the newest commit (at or below
        ``max_step``), or ``None`` on every rank."""
        assert self.peers is not None
        self.state.ensure_optimizer_state()
        targets, staged = self.state.load_targets()
        newest = found["newest"] if found["newest"] is not None else 0
        got = restore_from_memory(self.peers.memory, self.peers.pull_generation, targets, newest, self._control,
                                  self.rank, self.world_size, at_most=max_step)
        if got is None:
            return None
        step, saved_world, meta = got.generation.step, got.generation.world, got.trainer_meta
        self._apply_state(staged, meta, step)
        self.client_state.restore(self.config.checkpoint_dir, step, None, self._coord, self.config.commit_timeout_s)
        self._apply_streams(got.rng, step, meta, found["journal"])
        self._peer_fill = got.fill
        self._record_restore(step, saved_world, "memory", got.fill.own_bytes,
                             got.fill.held_bytes + got.fill.pulled_bytes, 0, [], rollback=rollback)
        return RestoreInfo(step, DataPosition.from_json(meta["position"]), saved_world, from_memory=True)

    def _restore_from_storage(self, found: dict[str, Any], max_step: int | None, *, rollback: bool, required: bool,
                              host: CommittedSnapshot | None) -> RestoreInfo | None:
        root = self.config.checkpoint_dir
        if not found["any"]:
            if rollback:
                return None
            if required:
                raise ReformFailed(f"rank {self.rank}: no committed checkpoint under {root} to resume from",
                                   round=self.round)
            log.info("rank %d: no checkpoint under %s: starting at step 0", self.rank, root)
            self.recorder.write("restore", step=0, world_size=self.world_size, saved_world_size=0)
            return RestoreInfo(0, DataPosition(), 0)
        self.state.ensure_optimizer_state()
        targets, staged = self.state.load_targets()
        host_bytes = 0
        self._peer_fill = PeerFill()
        if self.peers is not None:  # collective: every rank says what it holds, pulls what it lacks
            targets, self._peer_fill = self.peers.fill(targets, found["newest"], self._control, self.rank,
                                                       self.world_size)
            host_bytes = self._peer_fill.own_bytes
        elif host is not None and host.step == found["newest"] and not staged:
            # this rank's own part alone (no peer replicas): the same fill, from one part
            targets, copied = fill_from_parts(targets, [Part(host.step, self.rank, dict(host.tensors))])
            host_bytes = sum(copied.values())
        try:
            result = load(root, targets, max_step=max_step, coordinator=self._coord,
                          timeout_s=self.config.commit_timeout_s, read_bytes_per_s=self.config.restore_read_bytes_per_s)
            if result.step != found["newest"]:  # the same on every rank: see the docstring
                skipped = result.skipped  # the newer steps refused: they are set aside below
                targets, staged = self.state.load_targets()
                result = load(root, targets, step=result.step, coordinator=self._coord,
                              timeout_s=self.config.commit_timeout_s,
                              read_bytes_per_s=self.config.restore_read_bytes_per_s)
                result = replace(result, skipped=[*skipped, *result.skipped])
                host_bytes = 0
                self._peer_fill = PeerFill()
        except LayoutMismatch as exc:
            raise self._incompatible(None) or IncompatibleCheckpoint(str(exc)) from exc
        except CheckpointNotFound:
            if rollback:
                log.error("rank %d: no loadable checkpoint at or below step %d under %s", self.rank, max_step, root)
                return None
            log.error("rank %d: checkpoints exist under %s but none is loadable", self.rank, root)
            raise
        mismatch = self._incompatible(result.step)
        if mismatch is not None:
            raise mismatch
        for step, reason in result.skipped:
            log.warning("rank %d: skipped checkpoint step %d: %s", self.rank, step, reason)
        if result.skipped:
            # The re-run after this fall-back saves those steps again: free their numbers first.
            if self.rank == 0:
                for step, _ in result.skipped:
                    set_aside(root, step)
            if dist.is_initialized():
                dist.barrier()
        meta = result.metadata[0]["trainer"]
        self._apply_state(staged, meta, result.step)
        self.client_state.restore(root, result.step, result.metadata[0].get("client"), self._coord,
                                  self.config.commit_timeout_s)
        saved_world = result.world_size
        self._apply_streams(result.metadata[self.rank]["rng"] if self.rank < saved_world else None, result.step,
                            meta, found["journal"])
        self._record_restore(result.step, saved_world, "storage", host_bytes,
                             self._peer_fill.held_bytes + self._peer_fill.pulled_bytes, result.bytes_read,
                             [s for s, _ in result.skipped], rollback=rollback)
        return RestoreInfo(result.step, DataPosition.from_json(meta["position"]), saved_world, result.skipped)

    def _apply_state(self, staged: Any, meta: dict[str, Any], step: int) -> None:
        """The loaded tensors and the ZeRO metadata of ``step`` into the engine (both sources)."""
        self.state.apply_loaded(staged)
        self._check_data(meta, step)
        self.state.apply_metadata(meta["zero"])

    def _apply_streams(self, rng: dict[str, Any] | None, step: int, meta: dict[str, Any],
                       journal: list[Any]) -> None:
        """This rank's RNG streams (a fresh one when the world grew past the saved one) and the
        training-health history of ``step``, with the journal's rollbacks."""
        if rng is not None:
            _set_rng_state(rng)
        else:
            _seed_rng(self.config.seed * 1_000_003 + step * 1009 + self.rank)
        health = meta.get("health") or {}
        self.health = HealthMonitor(self.config.health, health.get("history", []))
        self.ledger.merge(RollbackLedger.from_json(health.get("rollbacks", [])).rollbacks)
        self.ledger.merge(RollbackLedger.from_json(journal).rollbacks)

    def _record_restore(self, step: int, saved_world: int, source: str, host_bytes: int, peer_bytes: int,
                        disk_bytes: int, skipped: list[int], *, rollback: bool) -> None:
        """Log the restore and write its record (collective: the world's bytes by source)."""
        self._restore_bytes = (host_bytes, disk_bytes)
        self._restored_from = source  # "memory" or "storage", for the rollback record
        sources = torch.tensor([host_bytes, peer_bytes, disk_bytes], dtype=torch.int64)
        dist.all_reduce(sources, group=self._control)
        world_host, world_peer, world_disk = (int(v) for v in sources.tolist())
        self._restore_sources = {"host_bytes": host_bytes, "peer_bytes": peer_bytes, "disk_bytes": disk_bytes,
                                 "world_host_bytes": world_host, "world_peer_bytes": world_peer,
                                 "world_disk_bytes": world_disk}  # for the rollback record
        log.info("rank %d round %d: restored step %d from %s (saved by %d ranks, now %d)%s; %d bytes from its own "
                 "memory, %d from peer replicas, %d read from storage", self.rank, self.round, step, source,
                 saved_world, self.world_size, " to roll back" if rollback else "", host_bytes, peer_bytes,
                 disk_bytes)
        if not rollback:
            self.recorder.write("restore", step=step, world_size=self.world_size, saved_world_size=saved_world,
                                source=source, skipped=skipped, rollbacks=len(self.ledger),
                                **self._restore_sources)  # fmt: skip

    def _check_data(self, meta: dict[str, Any], step: int) -> None:
        c = self.config
        for key in ("dataset_len", "seed", "shuffle"):
            if meta[key] != getattr(c, key):
                raise IncompatibleCheckpoint(
                    f"checkpoint step {step} was trained with {key}={meta[key]!r}, this run has {getattr(c, key)!r}: "
                    "the data order would change", step=step,
                )  # fmt: skip
        if meta["global_batch"] != c.global_batch:
            log.warning("rank %d: global batch changed from %d to %d at step %d", self.rank, meta["global_batch"],
                        c.global_batch, step)

    def _incompatible(self, step: int | None) -> IncompatibleCheckpoint | None:
        """The first tensor (model order) where checkpoint ``step`` (default: newest readable) differs."""
        steps = [step] if step is not None else [c.step for c in reversed(list_checkpoints(self.config.checkpoint_dir))
                                                 if c.committed]
        for s in steps:
            try:
                manifest = read_manifest(self.config.checkpoint_dir, s)
            except CheckpointError:
                continue
            expected = self.state.logical_shapes()
            for name, shape in expected:
                rec = manifest.tensors.get(name)
                if rec is None:
                    return IncompatibleCheckpoint(f"checkpoint step {s} has no tensor {name!r} (model: {list(shape)})",
                                                  tensor=name, step=s)
                if tuple(rec.shape) != shape:
                    return IncompatibleCheckpoint(
                        f"tensor {name!r}: checkpoint step {s} has shape {list(rec.shape)}, model has {list(shape)}",
                        tensor=name, step=s,
                    )  # fmt: skip
            names = {n for n, _ in expected}
            extra = sorted(n for n in manifest.tensors if n.startswith(("fp32/", "frozen/")) and n not in names)
            if extra:
                return IncompatibleCheckpoint(f"checkpoint step {s} has tensor {extra[0]!r}, which the model lacks",
                                              tensor=extra[0], step=s)
            return None
        return None


def _rng_state() -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": bytes(torch.get_rng_state().numpy()),
        "cuda": [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def _seed_rng(seed: int) -> None:
    """A rank with no saved RNG stream (the world grew) gets a fresh, reproducible one."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
