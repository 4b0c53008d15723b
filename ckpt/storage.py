"""The checkpoint root on a POSIX file system: listing, durable writes, locks, removal.

Layout: ``ROOT/step-000000000100/`` holds ``rank-NNNNN.bin`` shard files, a ``.lock`` file and,
once committed, ``manifest.json``. A directory without a manifest is an unfinished (or crashed)
save and is never loaded. Removal first renames a directory to ``.trash-*`` so no reader can find
a half-deleted checkpoint.

Locks are ``flock`` on ``.lock``: writers and loaders hold it shared, garbage collection needs it
exclusive (without waiting), so a checkpoint being written or loaded on this host is never deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from stalwart.ckpt.errors import CheckpointCorrupt, CheckpointNotFound
from stalwart.ckpt.format import (
    LOCK_NAME,
    MANIFEST_NAME,
    VERIFIED_NAME,
    Manifest,
    parse_manifest,
    parse_step_dir,
    step_dir_name,
)

log = logging.getLogger(__name__)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(directory: str, name: str, data: bytes) -> None:
    """Write ``directory/name`` so that readers see either nothing (or the old file) or all of it.

    Order: write a temporary file, fsync it, ``os.replace`` it over the name, fsync the directory.
    """
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, os.path.join(directory, name))
    fsync_dir(directory)


def step_path(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def is_committed(root: str, step: int) -> bool:
    return os.path.exists(os.path.join(step_path(root, step), MANIFEST_NAME))


def set_aside(root: str, step: int) -> str | None:
    """Move a checkpoint the loader refused (corrupt, incomplete) out of the way, keeping it for
    inspection as ``corrupt-step-…``: its step number becomes free for the re-run that follows
    a fall-back, and no loader looks at it again. Returns the new path (None if it was gone)."""
    src = step_path(root, step)
    dst = os.path.join(root, f"corrupt-{os.path.basename(src)}-{time.time_ns()}")
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return None
    fsync_dir(root)
    log.warning("set aside checkpoint step %d as %s", step, dst)
    return dst


def read_manifest(root: str, step: int) -> Manifest:
    """Read and check the manifest of ``step``.

    Raises :class:`CheckpointNotFound` when the step has no committed checkpoint, and whatever
    :func:`~stalwart.ckpt.format.parse_manifest` raises when the manifest is bad.
    """
    path = os.path.join(step_path(root, step), MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointNotFound(f"no committed checkpoint for step {step} under {root}") from None
    except OSError as exc:
        raise CheckpointCorrupt(f"cannot read manifest ({exc})", file=MANIFEST_NAME) from exc
    manifest = parse_manifest(data)
    if manifest.step != step:
        raise CheckpointCorrupt(f"manifest is for step {manifest.step}, directory for {step}", file=MANIFEST_NAME)
    return manifest


@dataclass(frozen=True)
class CheckpointInfo:
    """A step directory under the root. ``committed`` means a manifest exists (not that it is valid)."""

    step: int
    path: str
    committed: bool
    verified_digest: str | None
    mtime: float


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Every step directory under ``root``, oldest first; an absent root has none."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        step = parse_step_dir(name)
        if step is None:
            continue
        path = os.path.join(root, name)
        try:
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            continue
        committed = os.path.exists(os.path.join(path, MANIFEST_NAME))
        out.append(CheckpointInfo(step, path, committed, read_verified(path), mtime))
    return sorted(out, key=lambda c: c.step)


def committed_steps(root: str) -> list[int]:
    """Steps that have a manifest, newest first."""
    return [c.step for c in reversed(list_checkpoints(root)) if c.committed]


def mark_verified(step_dir: str, manifest_digest: str) -> None:
    """Record that every byte of the checkpoint with this manifest digest was read and matched."""
    body = json.dumps({"manifest_digest": manifest_digest, "verified_unix": time.time()}).encode()
    atomic_write(step_dir, VERIFIED_NAME, body)


def read_verified(step_dir: str) -> str | None:
    """The manifest digest recorded by :func:`mark_verified`, or ``None``."""
    try:
        with open(os.path.join(step_dir, VERIFIED_NAME), "rb") as f:
            value = json.loads(f.read()).get("manifest_digest")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@contextlib.contextmanager
def shared_lock(step_dir: str, *, create: bool) -> Iterator[None]:
    """Hold ``step_dir``'s lock shared (writers and loaders); blocks only while gc holds it.

    Raises :class:`CheckpointNotFound` if the directory is gone or was renamed by gc meanwhile.
    """
    flags = os.O_RDONLY | (os.O_CREAT if create else 0)
    lock_path = os.path.join(step_dir, LOCK_NAME)
    try:
        fd = os.open(lock_path, flags, 0o644)
    except FileNotFoundError:
        if not os.path.isdir(step_dir):
            raise CheckpointNotFound(f"{step_dir} no longer exists") from None
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            if create:
                raise
            # A read-only copy of a checkpoint: nobody can delete it under us either.
            log.debug("%s: no lock file and cannot create one (%s); reading without it", step_dir, exc)
            yield
            return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if not same:
            raise CheckpointNotFound(f"{step_dir} was removed while waiting for its lock")
        yield
    finally:
        os.close(fd)


def try_exclusive_lock(step_dir: str) -> int | None:
    """An fd holding ``step_dir``'s lock exclusively, or ``None`` if a writer or loader holds it."""
    try:
        fd = os.open(os.path.join(step_dir, LOCK_NAME), os.O_RDONLY | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_step_dir(root: str, step_dir: str) -> bool:
    """Remove a step directory unless someone holds its lock; returns whether it was removed.

    The directory is renamed to ``.trash-*`` under the lock first (atomic, so no loader can see
    a half-deleted checkpoint), then deleted. Leftover ``.trash-*`` from a crash are deleted too.
    """
    fd = try_exclusive_lock(step_dir)
    if fd is None:
        return False
    try:
        trash = os.path.join(root, f".trash-{os.path.basename(step_dir)}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(step_dir, trash)
        except FileNotFoundError:
            return False
        fsync_dir(root)
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def remove_trash(root: str) -> int:
    """Delete ``.trash-*`` directories left by a gc that was killed; returns how many."""
    count = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            if name.startswith(".trash-"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                count += 1
    return count
