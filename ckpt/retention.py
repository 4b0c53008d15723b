"""Retention: which checkpoints to keep, and garbage collection of the rest.

The choice (:func:`select_removals`) is a pure function of the committed steps and the policy.
:func:`collect_garbage` applies it: committed checkpoints outside the policy and unfinished save
directories are removed, each only if nobody holds its lock (a save or a load in progress on this
host), and only ever by renaming first (see ``storage.remove_step_dir``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from stalwart.ckpt.format import MANIFEST_NAME
from stalwart.ckpt.storage import list_checkpoints, remove_step_dir, remove_trash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed checkpoints, every step that is a multiple of
    ``keep_every`` (0: none), and always the newest checkpoint that passed a full verify.

    An unfinished directory (no manifest) is garbage once a newer step is committed, or once it is
    older than ``garbage_grace_s`` (so a save in progress elsewhere is not removed under it).
    """

    keep_last: int = 3
    keep_every: int = 0
    garbage_grace_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ValueError(f"keep_every must be >= 0, got {self.keep_every}")
        if self.garbage_grace_s < 0:
            raise ValueError(f"garbage_grace_s must be >= 0, got {self.garbage_grace_s}")


def select_removals(committed: Iterable[int], newest_verified: int | None, policy: RetentionPolicy) -> list[int]:
    """Committed steps the policy lets go, oldest first."""
    steps = sorted(set(committed), reverse=True)
    keep = set(steps[: policy.keep_last])
    if policy.keep_every:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    if newest_verified is not None:
        keep.add(newest_verified)
    return sorted(set(steps) - keep)


@dataclass
class GcReport:
    removed: list[int] = field(default_factory=list)
    garbage_removed: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)


def _manifest_digest(step_dir: str) -> str | None:
    try:
        with open(os.path.join(step_dir, MANIFEST_NAME), "rb") as f:
            value = json.loads(f.read()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def collect_garbage(
    root: str,
    policy: RetentionPolicy,
    *,
    protect: Iterable[int] = (),
    now: float | None = None,
    dry_run: bool = False,
) -> GcReport:
    """Apply ``policy`` under ``root``; steps in ``protect`` are never touched. Safe to run while
    saves and loads run on this host; on a shared file system across hosts, rely on the grace
    period for unfinished saves and never shrink ``keep_last`` below what other hosts may load."""
    now = time.time() if now is None else now
    protected = set(protect)
    infos = list_checkpoints(root)
    committed = [i.step for i in infos if i.committed]
    newest_committed = max(committed, default=None)
    newest_verified = None
    for info in reversed(infos):
        if info.committed and info.verified_digest and info.verified_digest == _manifest_digest(info.path):
            newest_verified = info.step
            break
    removals = set(select_removals(committed, newest_verified, policy)) - protected
    report = GcReport()
    for info in infos:
        if info.step in protected:
            report.kept.append(info.step)
            continue
        if info.committed:
            if info.step not in removals:
                report.kept.append(info.step)
                continue
            target = report.removed
        else:
            stale = newest_committed is not None and info.step < newest_committed
            if not stale and now - info.mtime < policy.garbage_grace_s:
                report.kept.append(info.step)
                continue
            target = report.garbage_removed
        if dry_run:
            target.append(info.step)
        elif remove_step_dir(root, info.path):
            target.append(info.step)
            log.info("gc: removed step %d (%s)", info.step, "committed" if info.committed else "unfinished")
        else:
            report.busy.append(info.step)
            log.info("gc: step %d is in use, kept for now", info.step)
    if not dry_run:
        remove_trash(root)
    return report
