"""The step record: which samples each step used, and which steps became committed progress.

Rank 0 appends one JSON line per event to a file (``TrainerConfig.record_path``):

- ``{"event": "restore", "step": S, "source": "storage" | "memory", ...}`` — a run started from
  checkpoint step ``S`` (0: none), or from a memory generation of step ``S`` (``generations.py``);
  steps above ``S`` recorded by earlier runs were lost and will be redone;
- ``{"event": "step", "step": k, "epoch": e, "world_size": w, "loss": x, "grad_norm": g,
  "samples": [...]}`` (``"update_skipped": true`` when fp16 overflow made DeepSpeed drop the update);
- ``{"event": "commit", "step": k}`` — the checkpoint of step ``k`` is committed;
- ``{"event": "save_failed", "step": k, "error": ...}`` — the checkpoint of step ``k`` did not
  commit (a full disk, a rank that could not write); training goes on, the previous one stands;
- ``{"event": "fault", "step": S, "kind": ..., "reason": ..., "loss": x, "samples": [...]}`` — step
  ``S`` failed a health check (see ``health.py``); it is not progress and is never checkpointed;
- ``{"event": "rollback", "step": R, "fault_step": S, "reason": ..., "skipped_samples": [...],
  "windows": [{"epoch": e, "start": a, "end": b, "samples": [...]}, ...], "disk_bytes": n, ...}``
  — training went back to step ``R`` in-process (``source``: ``"storage"``, its checkpoint, or
  ``"memory"``, a memory generation): recorded steps above ``R`` are dropped (as at a restore)
  and the listed samples are skipped for good (the next step is ``R + 1``, on the data after
  them); its byte counts by source are a restore record's;
- ``{"event": "startup", "step": k, "timings": {...}, "phases": {"imports": s, "world": s, "engine": s,
  "restore": s, "first step": s}}`` — the first step ``k`` of a process that started the job or
  joined it cold (not a spare), and where its time from the process's start went
  (``StartupTimings``);
- ``{"event": "gave_up", "step": S, "reason": ..., "rollbacks": n, ...}`` — too many rollbacks:
  the job stopped (``TrainingDiverged``).

:func:`committed_steps` replays such a file into the history of committed progress and
:func:`skipped_samples` lists what rollbacks skipped, so a test (or the chaos runner) can check
that every sample of an epoch was used exactly once or skipped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class StepRecorder:
    """Appends events to the record file; thread-safe (commits are recorded from the persist thread)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()


def read_events(path: str) -> list[dict[str, Any]]:
    """Every complete event line of the file; a torn last line (a process killed mid-write) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def committed_steps(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``step -> its step event`` for the steps of committed progress.

    A restore or rollback to step ``S`` drops every recorded step above ``S`` (they were redone),
    and only steps at or below the newest commit seen are committed.
    """
    steps: dict[int, dict[str, Any]] = {}
    last_commit = 0
    for ev in events:
        kind = ev.get("event")
        if kind in ("restore", "rollback"):
            restored = int(ev["step"])
            steps = {k: v for k, v in steps.items() if k <= restored}
            last_commit = restored
        elif kind == "step":
            steps[int(ev["step"])] = ev
        elif kind == "commit":
            last_commit = max(last_commit, int(ev["step"]))
    return {k: v for k, v in sorted(steps.items()) if k <= last_commit}


def skipped_samples(events: list[dict[str, Any]]) -> dict[int, list[int]]:
    """``epoch -> sorted sample indices`` that rollbacks skipped (never trained on in that epoch)."""
    out: dict[int, set[int]] = {}
    for ev in events:
        if ev.get("event") == "rollback":
            for w in ev.get("windows", []):
                out.setdefault(int(w["epoch"]), set()).update(int(i) for i in w["samples"])
    return {e: sorted(v) for e, v in sorted(out.items())}
