"""Training-health faults: the rollback a fault triggers, giving up, and injected faults.

:class:`RollbackMixin` is the part of :class:`~stalwart.trainer.Trainer` that acts on a fault
that :class:`~stalwart.trainer.health.HealthMonitor` found in a closed step (the same on every
rank): it restores, in-process, the newest restore point before the fault (a memory generation
newer than the last checkpoint, where there is one: at most ``memory_every - 1`` steps are
redone; else the checkpoint),
skips the data that led to it and records the rollback, or, past the rollback policy, stops with
:class:`TrainingDiverged`. Faults armed by tests and chaos runs (:meth:`inject_fault`) change
the loss a rank reports, which is what the checks see.
"""

from __future__ import annotations

import logging
import math
import signal

from stalwart.trainer.batching import StepBatch
from stalwart.trainer.errors import TrainingDiverged
from stalwart.trainer.health import SKIP_LAST_K, Fault, Rollback, windows_of, write_journal

log = logging.getLogger(__name__)


class RollbackMixin:
    """Mixed into :class:`~stalwart.trainer.Trainer`: uses its restore, saves and step counters."""

    def inject_fault(self, kind: str, step: int, factor: float = 0.0) -> None:
        """Make global step ``step`` look unhealthy on this rank, once (tests and chaos runs).

        ``kind="nan"``: the loss this rank reports for the step becomes NaN; ``"spike"``: it is
        multiplied by ``factor``. Only the reported loss changes (the weights do not), which is
        what the health checks see. Thread-safe (the agent client calls it from its own thread);
        a step already passed never fires.
        """
        if kind not in ("nan", "spike"):
            raise ValueError(f"fault kind must be 'nan' or 'spike', got {kind!r}")
        if kind == "spike" and not math.isfinite(factor):
            raise ValueError(f"spike factor must be finite, got {factor}")
        with self._inject_lock:
            self._injected.setdefault(int(step), []).append((kind, float(factor)))
        log.warning("rank %d: fault %s (factor %g) armed for step %d", self.rank, kind, factor, step)

    def _injected_loss(self, step: int, loss: float) -> float:
        with self._inject_lock:
            faults = self._injected.pop(step, [])
            for stale in [k for k in self._injected if k < step]:
                del self._injected[stale]
        for kind, factor in faults:
            loss = math.nan if kind == "nan" else loss * factor
            log.warning("rank %d step %d: injected fault %s: reported loss is now %s", self.rank, step, kind, loss)
        return loss

    def _on_fault(self, batch: StepBatch, fault: Fault, loss: float, grad_norm: float | None) -> None:
        """Roll back to the newest restore point before the fault and skip its data, or give up."""
        s, hc = batch.step, self.config.health
        log.error("rank %d step %d: training-health fault %s: %s", self.rank, s, fault.kind, fault.reason)
        self.recorder.write("fault", step=s, kind=fault.kind, reason=fault.reason, loss=loss, grad_norm=grad_norm,
                            epoch=batch.epoch, samples=list(batch.samples))
        recent = self.ledger.recent(s, hc.rollback_window)
        if len(recent) >= hc.max_rollbacks:
            self._give_up(s, fault, f"{len(recent) + 1} faults within {hc.rollback_window} steps, more than the "
                                    f"{hc.max_rollbacks} rollbacks allowed", recent)
        self._settle_saves()  # a checkpoint of step s - 1 may be in flight: it is the one to go back to
        restored = self._restore(max_step=s - 1, rollback=True)
        if restored is None:
            self._give_up(s, fault, f"no good checkpoint before step {s} to roll back to", recent)
        assert restored is not None
        # The batches since the checkpoint, as they were handed out (the same skips applied).
        replay = self._sampler(restored.position)
        since = [replay.next_batch(k) for k in range(restored.step + 1, s + 1)]
        if since[-1].samples != batch.samples:
            log.error("rank %d step %d: replayed data differs from the batch trained: skipping it anyway",
                      self.rank, s)
        skipped = since[-hc.skip_last:] if hc.skip == SKIP_LAST_K else since
        rollback = Rollback(s, restored.step, fault.reason, windows_of(skipped))
        self.ledger.add(rollback)
        if self.rank == 0:
            try:
                write_journal(self.config.checkpoint_dir, self.ledger)
            except OSError as exc:  # the checkpoints still carry it from the next save on
                log.error("rank 0 step %d: cannot write the rollback journal: %s", s, exc)
        windows = [{**w.to_json(), "samples": [i for b in skipped if b.epoch == w.epoch for i in b.samples]}
                   for w in rollback.windows]
        self.recorder.write("rollback", step=restored.step, fault_step=s, kind=fault.kind, reason=fault.reason,
                            skip=hc.skip, skipped_steps=[b.step for b in skipped],
                            skipped_samples=[i for b in skipped for i in b.samples], windows=windows,
                            rollbacks=len(recent) + 1, world_size=self.world_size, source=self._restored_from,
                            **self._restore_sources)  # fmt: skip
        log.warning("rank %d step %d: rolled back to step %d, skipping %d batches (steps %d..%d) of data",
                    self.rank, s, restored.step, len(skipped), skipped[0].step, skipped[-1].step)
        self.restored = restored
        self.sampler = self._sampler(restored.position)
        self.step = restored.step
        self._batch = None
        self._last_saved = -1 if restored.from_memory else restored.step  # finish() saves a step only in memory
        self._skipped_seen = int(getattr(self.engine, "skipped_steps", 0))
        self.rollbacks += 1

    def _give_up(self, step: int, fault: Fault, why: str, recent: list[Rollback]) -> None:
        """Stop for good: let healthy checkpoints in flight commit, record why, raise on every rank."""
        hc = self.config.health
        message = f"training diverged at step {step}: {why}; last fault: {fault.reason}"
        log.error("rank %d step %d: %s", self.rank, step, message)
        self.recorder.write("gave_up", step=step, kind=fault.kind, reason=message, fault=fault.reason,
                            rollbacks=len(recent), max_rollbacks=hc.max_rollbacks, window=hc.rollback_window,
                            recent_fault_steps=[r.fault_step for r in recent])  # fmt: skip
        self._settle_saves()
        self._closed = True
        self.stopped = True
        self.checkpointer.close()
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
        self.agent.close("diverged")
        raise TrainingDiverged(message, step=step, reason=fault.reason, rollbacks=[r.to_json() for r in recent])
