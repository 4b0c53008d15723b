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

from stalwart.ckpt.errors import CheckpointError, CheckpointNotFound
from stalwart.ckpt.format import MANIFEST_NAME
from stalwart.ckpt.storage import check_intact, list_checkpoints, remove_step_dir, remove_trash

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
    """Committed steps the policy lets go, oldest first. ``committed`` must hold only checkpoints
    known to be good: what it holds is what ``keep_last`` counts."""
    steps = sorted(set(committed), reverse=True)
    keep = set(steps[: policy.keep_last])
    if policy.keep_every:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    if newest_verified is not None:
        keep.add(newest_verified)
    return sorted(set(steps) - keep)


@dataclass
class GcReport:
    """What a collection did. ``damaged``: committed steps that are not intact (kept, never counted);
    ``errors``: ``(step, why)`` for each removal the file system refused (e.g. a read-only root)."""

    removed: list[int] = field(default_factory=list)
    garbage_removed: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    damaged: list[tuple[int, str]] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)


def _manifest_digest(step_dir: str) -> str | None:
    try:
        with open(os.path.join(step_dir, MANIFEST_NAME), "rb") as f:
            value = json.loads(f.read()).get("digest")
    except (OSError, ValueError, AttributeError, RecursionError):
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
    period for unfinished saves and never shrink ``keep_last`` below what other hosts may load.

    Only intact checkpoints (``storage.check_intact``: the manifest passes every check, each file
    has its size and header) count towards ``keep_last``, so the newest good checkpoint is never
    removed because of newer damaged or unverifiable ones; damaged ones are kept for inspection.
    A removal the file system refuses is reported in ``errors``, not raised."""
    now = time.time() if now is None else now
    protected = set(protect)
    infos = list_checkpoints(root)
    committed = [i for i in infos if i.committed]
    newest_committed = max((i.step for i in committed), default=None)
    newest_verified = None
    for info in reversed(infos):
        if info.committed and info.verified_digest and info.verified_digest == _manifest_digest(info.path):
            newest_verified = info.step
            break
    report = GcReport()
    # Judge from the newest down; once keep_last good ones are found, older steps are candidates
    # for removal, but a step the policy keeps anyway (keep_every, verified) need not be read.
    good: list[int] = []
    damaged: set[int] = set()
    for info in reversed(committed):
        exempt = info.step == newest_verified or (policy.keep_every and info.step % policy.keep_every == 0)
        if len(good) >= policy.keep_last and exempt:
            good.append(info.step)
            continue
        try:
            check_intact(root, info.step)
        except CheckpointNotFound:
            continue  # removed meanwhile
        except CheckpointError as exc:
            damaged.add(info.step)
            report.damaged.append((info.step, f"{type(exc).__name__}: {exc}"))
            continue
        good.append(info.step)
    removals = set(select_removals(good, newest_verified, policy)) - protected
    for info in infos:
        if info.step in protected or info.step in damaged:
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
            continue
        try:
            removed = remove_step_dir(root, info.path)
        except OSError as exc:
            report.errors.append((info.step, f"{exc.strerror or exc}"))
            log.info("gc: cannot remove step %d: %s", info.step, exc)
            continue
        if removed:
            target.append(info.step)
            log.info("gc: removed step %d (%s)", info.step, "committed" if info.committed else "unfinished")
        else:
            report.busy.append(info.step)
            log.info("gc: step %d is in use, kept for now", info.step)
    report.damaged.sort()
    if not dry_run:
        remove_trash(root)
    return report
