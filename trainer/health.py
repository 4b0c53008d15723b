"""Training-health checks: which steps are faults, and how many rollbacks a job may take.

Pure logic (no process group, no DeepSpeed), so every rule is tested without a network. The
trainer feeds it values every rank already agrees on (the per-step control all-reduce), so all
ranks reach the same verdict without another collective.

A step is a **fault** when

- the loss is not finite on some rank (``nonfinite_loss``), or the global gradient norm is not
  finite (``nonfinite_grad_norm``, where the engine reports one);
- or the loss **spikes**: it exceeds the median of the last ``spike_window`` healthy losses by
  more than ``spike_threshold`` times their median absolute deviation (MAD), the MAD being floored
  at ``spike_rel_floor * |median|``. The median and MAD ignore isolated outliers (unlike a mean
  and a standard deviation, which one spike inflates); the floor keeps a plateau whose MAD is near
  zero from calling a tiny move a spike. Only rises count (a loss that drops is no fault), and not
  before ``spike_min_history`` healthy losses are known.

A step whose optimizer update the engine skipped (fp16 overflow: DeepSpeed's loss scaler lowers
the scale and drops the step, ``engine.skipped_steps`` grows) is never a fault: no weight changed,
and overflows are how dynamic loss scaling finds its scale. Its loss stays out of the history.
But ``max_skipped_updates`` skipped updates in a row are a fault (``skipped_updates``): a scale
that never recovers means the gradients are NaN whatever the scale, and the job makes no progress.

A fault makes the trainer roll back to the newest restore point before it (a memory generation
newer than the last checkpoint, or that checkpoint) and skip the data that led to it
(:class:`Rollback`). More than ``max_rollbacks`` faults within ``rollback_window`` steps
means the job diverges whatever data it sees: it stops (``TrainingDiverged``). The rollbacks are
kept in each checkpoint and in a small journal next to the checkpoints (:func:`write_journal`),
so a job restarted after a crash or after giving up still counts them and still skips their data.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.trainer.batching import DataWindow

SKIP_SINCE_CHECKPOINT = "since_checkpoint"
SKIP_LAST_K = "last_k"
JOURNAL_NAME = "health-rollbacks.json"


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of the health checks and the rollback policy (see the module docstring).

    ``skip``: which data a rollback skips: ``"since_checkpoint"`` (every batch after the restored
    step, a checkpoint or a memory generation, up to and including the fault step) or ``"last_k"``
    (the last ``skip_last`` of those batches; the batches before them are trained again, on the
    same samples).
    ``check_grad_norm``: also treat a non-finite global gradient norm as a fault.
    ``max_skipped_updates``: this many consecutive updates skipped by the engine are a fault.
    """

    enabled: bool = True
    check_grad_norm: bool = True
    spike_window: int = 100
    spike_threshold: float = 10.0
    spike_min_history: int = 20
    spike_rel_floor: float = 0.05
    skip: str = SKIP_SINCE_CHECKPOINT
    skip_last: int = 1
    max_rollbacks: int = 3
    rollback_window: int = 1000
    max_skipped_updates: int = 50

    def __post_init__(self) -> None:
        if self.spike_window < 3:
            raise ValueError(f"spike_window must be >= 3 (a median needs a few losses), got {self.spike_window}")
        if not 3 <= self.spike_min_history <= self.spike_window:
            raise ValueError(
                f"spike_min_history must be within [3, spike_window={self.spike_window}], got {self.spike_min_history}"
            )
        if not self.spike_threshold > 0:
            raise ValueError(f"spike_threshold (in MADs) must be positive, got {self.spike_threshold}")
        if not self.spike_rel_floor >= 0:
            raise ValueError(f"spike_rel_floor must be >= 0, got {self.spike_rel_floor}")
        if self.skip not in (SKIP_SINCE_CHECKPOINT, SKIP_LAST_K):
            raise ValueError(f"skip must be {SKIP_SINCE_CHECKPOINT!r} or {SKIP_LAST_K!r}, got {self.skip!r}")
        if self.skip_last < 1:
            raise ValueError(f"skip_last must be >= 1, got {self.skip_last}")
        if self.max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0, got {self.max_rollbacks}")
        if self.rollback_window < 1:
            raise ValueError(f"rollback_window must be >= 1 step, got {self.rollback_window}")
        if self.max_skipped_updates < 1:
            raise ValueError(f"max_skipped_updates must be >= 1, got {self.max_skipped_updates}")


@dataclass(frozen=True)
class Fault:
    """Why a step is a fault: ``kind`` is ``nonfinite_loss``, ``nonfinite_grad_norm``, ``spike`` or
    ``skipped_updates``."""

    step: int
    kind: str
    reason: str


@dataclass(frozen=True)
class SpikeScore:
    """How far ``loss`` is above the window's median, in floored MADs (``score``)."""

    median: float
    mad: float
    scale: float
    score: float


def spike_score(history: Sequence[float], loss: float, rel_floor: float) -> SpikeScore:
    """``(loss - median) / max(MAD, rel_floor * |median|)`` over ``history`` (non-empty)."""
    median = statistics.median(history)
    mad = statistics.median(abs(x - median) for x in history)
    scale = max(mad, rel_floor * abs(median), 1e-12)
    return SpikeScore(median, mad, scale, (loss - median) / scale)


class HealthMonitor:
    """Judges each step and keeps the recent healthy losses (``(step, loss)``) the spike rule needs."""

    def __init__(self, config: HealthConfig, history: Iterable[Sequence[float]] = ()) -> None:
        self.config = config
        self._history: deque[tuple[int, float]] = deque(maxlen=config.spike_window)
        self._skipped_run = 0  # consecutive updates the engine skipped, up to the last accepted step
        for step, loss in history:
            self._history.append((int(step), float(loss)))

    @property
    def history(self) -> list[tuple[int, float]]:
        return list(self._history)

    def check(self, step: int, loss: float, *, loss_finite: bool = True, grad_norm: float | None = None,
              update_skipped: bool = False) -> Fault | None:
        """The fault of ``step`` or ``None``. ``loss`` is the mean over ranks; ``loss_finite`` is
        False when any rank's loss was not finite; ``update_skipped``: the engine dropped the update."""
        c = self.config
        if not c.enabled:
            return None
        if update_skipped:
            if self._skipped_run + 1 >= c.max_skipped_updates:
                return Fault(step, "skipped_updates", f"{self._skipped_run + 1} updates in a row skipped by the "
                                                      f"engine (overflow) up to step {step}: the loss scale does "
                                                      f"not recover")  # fmt: skip
            return None
        if not loss_finite or not math.isfinite(loss):
            return Fault(step, "nonfinite_loss", f"loss is {loss} at step {step}")
        if c.check_grad_norm and grad_norm is not None and not math.isfinite(grad_norm):
            return Fault(step, "nonfinite_grad_norm", f"global gradient norm is {grad_norm} at step {step}")
        if len(self._history) >= c.spike_min_history:
            s = spike_score([x for _, x in self._history], loss, c.spike_rel_floor)
            if s.score > c.spike_threshold:
                return Fault(step, "spike", (
                    f"loss {loss:.6g} at step {step} is {s.score:.1f} MADs above the median {s.median:.6g} of the "
                    f"last {len(self._history)} steps (MAD {s.mad:.3g}, floored to {s.scale:.3g}; "
                    f"threshold {c.spike_threshold:g})"))  # fmt: skip
        return None

    def accept(self, step: int, loss: float, *, update_skipped: bool = False) -> None:
        """Add a healthy step's loss to the window (skipped updates and non-finite losses stay out)."""
        self._skipped_run = self._skipped_run + 1 if update_skipped else 0
        if not update_skipped and math.isfinite(loss):
            self._history.append((step, float(loss)))

    def to_json(self) -> list[list[float]]:
        return [[s, x] for s, x in self._history]


@dataclass(frozen=True)
class Rollback:
    """One rollback: the fault at ``fault_step`` sent training back to step ``restored_step`` (a
    checkpoint or a memory generation) and the data ``windows`` were skipped."""

    fault_step: int
    restored_step: int
    reason: str
    windows: tuple[DataWindow, ...] = ()
    time: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[int, tuple[DataWindow, ...]]:
        return (self.fault_step, self.windows)

    def to_json(self) -> dict[str, Any]:
        return {"fault_step": self.fault_step, "restored_step": self.restored_step, "reason": self.reason,
                "windows": [w.to_json() for w in self.windows], "time": self.time}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Rollback:
        return cls(int(obj["fault_step"]), int(obj["restored_step"]), str(obj["reason"]),
                   tuple(DataWindow.from_json(w) for w in obj.get("windows", [])), float(obj.get("time", 0.0)))


class RollbackLedger:
    """Every rollback of the job so far (merged from checkpoints and the journal, without duplicates)."""

    def __init__(self, rollbacks: Iterable[Rollback] = ()) -> None:
        self._items: dict[tuple[int, tuple[DataWindow, ...]], Rollback] = {}
        self.merge(rollbacks)

    def merge(self, rollbacks: Iterable[Rollback]) -> None:
        for rb in rollbacks:
            self._items.setdefault(rb.key, rb)

    def add(self, rollback: Rollback) -> None:
        self._items[rollback.key] = rollback

    @property
    def rollbacks(self) -> list[Rollback]:
        return sorted(self._items.values(), key=lambda r: (r.time, r.fault_step))

    def windows(self) -> list[DataWindow]:
        return sorted({w for rb in self._items.values() for w in rb.windows})

    def recent(self, fault_step: int, window: int) -> list[Rollback]:
        """Rollbacks whose fault lies less than ``window`` steps from ``fault_step`` (either side:
        after a restart from an older checkpoint, step numbers repeat)."""
        return [rb for rb in self.rollbacks if abs(rb.fault_step - fault_step) < window]

    def exhausted(self, fault_step: int, config: HealthConfig) -> bool:
        """True when a fault at ``fault_step`` would be one rollback more than the limit allows."""
        return len(self.recent(fault_step, config.rollback_window)) >= config.max_rollbacks

    def to_json(self) -> list[dict[str, Any]]:
        return [rb.to_json() for rb in self.rollbacks]

    @classmethod
    def from_json(cls, items: Iterable[dict[str, Any]]) -> RollbackLedger:
        return cls(Rollback.from_json(x) for x in items)

    def __len__(self) -> int:
        return len(self._items)


def journal_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, JOURNAL_NAME)


def read_journal(checkpoint_dir: str) -> list[dict[str, Any]]:
    """The journal's rollbacks as JSON (empty when absent or unreadable: it only adds to checkpoints)."""
    try:
        with open(journal_path(checkpoint_dir)) as f:
            obj = json.load(f)
        return list(obj["rollbacks"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_journal(checkpoint_dir: str, ledger: RollbackLedger) -> None:
    """Replace the journal atomically (written by rank 0 at each rollback, before the restore)."""
    from stalwart.ckpt import atomic_write

    os.makedirs(checkpoint_dir, exist_ok=True)
    body = json.dumps({"format": 1, "rollbacks": ledger.to_json()}, indent=1).encode()
    atomic_write(checkpoint_dir, JOURNAL_NAME, body)


def windows_of(batches: Sequence[Any]) -> tuple[DataWindow, ...]:
    """The data windows covered by consecutive batches (``StepBatch``): one per epoch touched."""
    spans: dict[int, list[int]] = {}
    for b in batches:
        lo_hi = spans.setdefault(b.epoch, [b.start, b.end])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], b.start), max(lo_hi[1], b.end)
    return tuple(DataWindow(e, lo, hi) for e, (lo, hi) in sorted(spans.items()))
