"""Asynchronous checkpoints: the saves themselves, the last one, and what became of each.

:class:`SavesMixin` is the part of :class:`~stalwart.trainer.Trainer` that snapshots the current
step into a save (ZeRO partitions, registered client state, trainer metadata and RNG), waits for
the commit in flight when it must, and reports each save once it commits or fails: to the agent,
to the step record and to the peer replicas. ``step_done`` decides when a save is due.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stalwart.ckpt import (
    CheckpointError,
    CommitFailed,
    CommitInfo,
    LayoutMismatch,
    SaveHandle,
    encode_metadata,
    host_copy,
    list_checkpoints,
)
from stalwart.trainer.peer_wire import Part
from stalwart.trainer.restore import _rng_state

log = logging.getLogger(__name__)
FINAL_SAVE_RETRY_EVERY_S = 2.0


class SavesMixin:
    """Mixed into :class:`~stalwart.trainer.Trainer`: saves its current step through its checkpointer."""

    def register_state(self, name: str, obj: Any = None, *, save: Callable[[], Any] | None = None,
                       load: Callable[[Any], None] | None = None) -> None:
        """Save and restore user state (an EMA, a data mixer) with the checkpoints: ``obj`` with
        ``state_dict()``/``load_state_dict()``, or ``save``/``load`` callables. The same on every
        rank; restored at once if the checkpoint restored has it. See ``client_state.py``."""
        self.client_state.register(name, obj, save=save, load=load)

    def save(self) -> SaveHandle:
        """Checkpoint the current step asynchronously (returns after the snapshot). Collective."""
        self.state.ensure_optimizer_state()
        client_tensors, client_meta = self.client_state.snapshot()
        meta = {"trainer": self._trainer_meta(), "rng": _rng_state(), "client": client_meta}
        handle = self.checkpointer.save(self.step, {**self.state.save_tensors(), **client_tensors}, meta)
        self._pending.append(handle)
        if self.peers is not None:
            self.peers.replicate(handle, self.rank)  # on a thread, once the snapshot is copied
        self._last_saved = self.step
        self._last_save_time = time.monotonic()
        return handle

    def _memory_due(self) -> bool:
        """Whether the step just closed (not a save) gets a memory generation: every rank
        decides alike, from the configuration and the step."""
        every = self.config.peer.memory_every
        return (self.peers is not None and every > 0 and self.step % every == 0
                and not self.client_state.registered)  # fmt: skip

    def _keep_generation(self) -> None:
        """This rank's part of a memory generation of the current step (``trainer/generations.py``):
        what a save would write, with its metadata, copied to host memory and pushed to the
        buddies in the background; never written to storage."""
        assert self.peers is not None
        self.state.ensure_optimizer_state()
        try:
            meta = encode_metadata({"trainer": self._trainer_meta(), "rng": _rng_state()})
        except LayoutMismatch as exc:  # a save of this step would fail the same way
            log.warning("rank %d step %d: no memory generation: %s", self.rank, self.step, exc)
            return
        tensors = host_copy(self.state.save_tensors(), self.rank, self.world_size)
        self.peers.keep_generation(Part(self.step, self.rank, tensors, tag=self.peers.memory.lineage,
                                        world=self.world_size, meta=meta))

    def finish(self) -> CommitInfo | None:
        """Save the current step unless saved already, wait for its commit, release resources.
        Collective. A last save that does not commit is tried again for ``final_save_retry_s``.

        Raises what the last save raised (e.g. :class:`~stalwart.ckpt.CommitFailed`); the agent
        is then told the worker failed, not that it finished.
        """
        if self._closed:
            return None
        committed = False
        try:
            info = self._commit_last()
            committed = True
            return info
        finally:
            self._closed = True
            self._report_saves()
            self.checkpointer.close()
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
            self.agent.close("sigterm" if self._sigterm else "finished" if committed else "failed")

    def _commit_last(self) -> CommitInfo | None:
        """Save and commit the current step, again after each failure until ``final_save_retry_s``
        has passed; every rank tries again or gives up alike (one all-reduce per attempt)."""
        deadline = time.monotonic() + self.config.final_save_retry_s
        while True:
            if self._last_saved != self.step:
                self.save()
            info, error = None, None
            try:
                info = self.checkpointer.wait()
            except CheckpointError as exc:
                error = exc
            # Rank 0 says whether the step is committed after all (another rank's wait timed out
            # while rank 0 committed it): every rank goes by its word, not by its own listing.
            committed = self.rank == 0 and error is not None and self.step in {
                c.step for c in list_checkpoints(self.config.checkpoint_dir) if c.committed}
            flags = torch.tensor([float(error is not None), float(time.monotonic() >= deadline), float(committed)],
                                 dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(flags, group=self._control)
            if flags[0].item() == 0 or flags[2].item() > 0:
                return info
            self._report_saves()  # the agent hears of the failure (the operator is told) now
            if flags[1].item() > 0:
                raise error or CommitFailed(f"step {self.step} not committed: another rank's save failed")
            log.error("rank %d step %d: last checkpoint not committed (%s): trying again in %.0f s", self.rank,
                      self.step, error, FINAL_SAVE_RETRY_EVERY_S)
            time.sleep(FINAL_SAVE_RETRY_EVERY_S)
            self._last_saved = -1  # the same step, saved again

    def _settle_saves(self) -> None:
        """Wait for the save in flight; a failed one is logged (the loader never sees it)."""
        try:
            self.checkpointer.wait()
        except Exception as exc:  # noqa: BLE001 - reported below through the handle
            log.warning("rank %d step %d: checkpoint in flight failed: %s", self.rank, self.step, exc)
        self._report_saves()

    def _on_commit(self, info: CommitInfo) -> None:
        self.recorder.write("commit", step=info.step)

    def _report_saves(self) -> None:
        for handle in [h for h in self._pending if h.done()]:
            self._pending.remove(handle)
            exc = handle.exception()
            if exc is None:
                info = handle.result()
                self.agent.checkpoint(info.step, info.path, True, info.snapshot_s)
                kept = self.checkpointer.committed_snapshot()
                if self.peers is not None and kept is not None and kept.step == info.step:
                    self.peers.keep_own(kept, self.rank)
            else:
                log.error("rank %d step %d: checkpoint not committed: %s", self.rank, handle.step, exc)
                self.recorder.write("save_failed", step=handle.step, error=str(exc))
                self.agent.checkpoint(handle.step, "", False)
