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
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from stalwart.ckpt.errors import CheckpointCorrupt, CheckpointError, CheckpointExists, CheckpointNotFound, UnsafePath
from stalwart.ckpt.format import (
    FENCE_NAME,
    HEADER_SIZE,
    LOCK_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    VERIFIED_NAME,
    Manifest,
    check_header,
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


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _write_temp(directory: str, name: str, data: bytes) -> str:
    """A fresh, fsynced temporary file next to ``name`` holding ``data`` (created with O_EXCL, so
    a link planted at its path is refused, never followed); returns its path."""
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
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
    return tmp


def atomic_write(directory: str, name: str, data: bytes) -> None:
    """Write ``directory/name`` so that readers see either nothing (or the old file) or all of it.

    Order: write a fresh temporary file, fsync it, ``os.replace`` it over the name (a link at the
    name is replaced, not followed), fsync the directory.
    """
    tmp = _write_temp(directory, name, data)
    try:
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def create_exclusive(directory: str, name: str, data: bytes) -> None:
    """Like :func:`atomic_write`, but refuse (:class:`CheckpointExists`) if ``name`` exists: the
    temporary file is hard-linked to the name, which fails atomically when it is taken. This is
    what makes a commit happen once: of two writers of one step, the second is refused."""
    tmp = _write_temp(directory, name, data)
    target = os.path.join(directory, name)
    try:
        try:
            os.link(tmp, target, follow_symlinks=False)
        except FileExistsError:
            raise CheckpointExists(f"{target} exists: another writer committed first") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # No hard links on this file system: the check and the rename are two steps.
            if os.path.lexists(target):
                raise CheckpointExists(f"{target} exists: another writer committed first") from None
            os.rename(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    try:
        fsync_dir(directory)
    except BaseException:
        os.unlink(target)  # not known durable: take it back, so the caller's failure is the truth
        raise


def ensure_step_dir(root: str, step: int) -> str:
    """Create (or find) the directory of ``step`` and check it is a real directory directly under
    ``root``: a link planted at its path would send every write elsewhere. Raises
    :class:`UnsafePath`."""
    path = step_path(root, step)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory (a link or a file); refusing to write through it")
    return path


def open_regular(path: str) -> int:
    """Open ``path`` for reading only if it is a regular file reached without a link: a planted
    link, FIFO or device in a checkpoint is refused (``OSError``), never followed or waited on."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        fd = open_regular(path)
    except FileNotFoundError:
        raise CheckpointNotFound(f"no committed checkpoint for step {step} under {root}") from None
    except OSError as exc:
        raise CheckpointCorrupt(f"cannot read manifest ({exc.strerror or exc})", file=MANIFEST_NAME) from exc
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise CheckpointCorrupt(f"cannot read manifest ({exc.strerror or exc})", file=MANIFEST_NAME) from exc
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


def clear_verified(step_dir: str) -> None:
    """Drop the verified mark (a verify failed): a defect found later must not stay hidden."""
    path = os.path.join(step_dir, VERIFIED_NAME)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(step_dir)


def read_verified(step_dir: str) -> str | None:
    """The manifest digest recorded by :func:`mark_verified`, or ``None``."""
    try:
        with open(os.path.join(step_dir, VERIFIED_NAME), "rb") as f:
            data = f.read(4096)
        value = json.loads(data).get("manifest_digest")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def check_intact(root: str, step: int) -> Manifest:
    """The manifest of ``step`` if the checkpoint is structurally sound: the manifest passes every
    check and each shard file has its size and an intact header. Reads no chunk, so it is cheap
    enough for retention; only :func:`~stalwart.ckpt.verify.verify` reads every byte. Raises
    :class:`CheckpointError` (corrupt, unsupported, gone)."""
    manifest = read_manifest(root, step)
    step_dir = step_path(root, step)
    for name, record in manifest.files.items():
        try:
            fd = open_regular(os.path.join(step_dir, name))
        except OSError as exc:
            raise CheckpointCorrupt(f"shard file cannot be opened ({exc.strerror})", file=name) from exc
        try:
            size = os.fstat(fd).st_size
            if size != record.size:
                raise CheckpointCorrupt(f"file has {size} bytes, manifest says {record.size}", file=name)
            header = os.pread(fd, HEADER_SIZE, 0)
        finally:
            os.close(fd)
        check_header(header, file=name, rank=record.rank, world_size=manifest.world_size, step=manifest.step)
    return manifest


def read_fence(root: str) -> int | None:
    """The highest fencing token that committed under ``root`` (``fence.json``), or ``None``."""
    try:
        with open(os.path.join(root, FENCE_NAME), "rb") as f:
            value = json.loads(f.read(4096)).get("fence")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{root}/{FENCE_NAME} is unreadable ({exc}); remove it to reset fencing") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{root}/{FENCE_NAME} holds no fencing token; remove it to reset fencing")
    return value


def write_fence(root: str, fence: int) -> None:
    atomic_write(root, FENCE_NAME, json.dumps({"fence": fence, "updated_unix": time.time()}).encode())


@contextlib.contextmanager
def root_commit_lock(root: str) -> Iterator[None]:
    """Serialize commits under ``root`` on this host (and on file systems with working flock), so
    the fence check and the manifest link of one commit are not interleaved with another's."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # the root itself: no extra file in it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def shared_lock(step_dir: str, *, create: bool) -> Iterator[None]:
    """Hold ``step_dir``'s lock shared (writers and loaders); blocks only while gc holds it.

    Raises :class:`CheckpointNotFound` if the directory is gone or was renamed by gc meanwhile.
    """
    flags = os.O_RDONLY | _NOFOLLOW | (os.O_CREAT if create else 0)
    lock_path = os.path.join(step_dir, LOCK_NAME)
    try:
        fd = os.open(lock_path, flags, 0o644)
    except FileNotFoundError:
        if not os.path.isdir(step_dir):
            raise CheckpointNotFound(f"{step_dir} no longer exists") from None
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as exc:
            if create:
                raise
            # A read-only copy of a checkpoint: nobody can delete it under us either.
            log.debug("%s: no lock file and cannot create one (%s); reading without it", step_dir, exc)
            yield
            return
    except OSError as exc:  # a link or worse planted at the lock's name
        if create:
            raise
        raise CheckpointCorrupt(f"lock file cannot be opened ({exc.strerror or exc})", file=LOCK_NAME) from exc
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
        fd = os.open(os.path.join(step_dir, LOCK_NAME), os.O_RDONLY | os.O_CREAT | _NOFOLLOW, 0o644)
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
