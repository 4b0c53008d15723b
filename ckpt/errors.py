"""The exceptions of ``stalwart.ckpt``: one type per failure a caller can act on.

Everything raised on purpose by this package derives from :class:`CheckpointError`. A loader
that meets :class:`CheckpointCorrupt` or :class:`UnsupportedFormat` in one checkpoint falls back
to the next older one; :class:`LayoutMismatch` is the caller's mistake and is never retried.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error raised by ``stalwart.ckpt``."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint (or not the requested step) exists under the root."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's bytes do not match what its manifest promises.

    ``file`` is the file inside the checkpoint directory (``manifest.json`` or a shard file);
    ``chunk`` is the index of the chunk inside that file, or ``None`` when the problem is not in
    one chunk (header, size, missing file, unreadable manifest).
    """

    def __init__(self, message: str, *, file: str | None = None, chunk: int | None = None) -> None:
        where = file or "?"
        if chunk is not None:
            where = f"{where} chunk {chunk}"
        super().__init__(f"{where}: {message}")
        self.file = file
        self.chunk = chunk
        self.reason = message


class UnsafePath(CheckpointCorrupt):
    """A manifest names a file outside its checkpoint directory (``..``, absolute, separators)."""


class UnsupportedFormat(CheckpointError):
    """The checkpoint was written in a format this reader does not understand.

    Raised for a newer major format version, an unknown codec, hash or dtype. Upgrade stalwart to
    read it; older checkpoints remain loadable.
    """


class LayoutMismatch(CheckpointError):
    """What the caller asked for does not fit what was saved (or what it passed in is inconsistent).

    Examples: a tensor the checkpoint does not have, another dtype or global shape, a region that
    leaves the tensor's bounds, ranks that disagree about a tensor's shape at save time. Never
    retried on an older checkpoint: the request itself is wrong.
    """


class CheckpointExists(CheckpointError):
    """A committed checkpoint for this step is already on disk; it is never overwritten."""


class SaveInProgress(CheckpointError):
    """A save was requested while the previous one is still persisting (``if_busy="raise"``)."""


class CommitFailed(CheckpointError):
    """The checkpoint was not committed: a rank failed to persist its shard, or coordination failed.

    Nothing of this step is loadable; the previous committed checkpoint is untouched.
    """


class CommitTimeout(CommitFailed, TimeoutError):
    """Coordination of the commit did not finish within ``commit_timeout_s``."""


class CommitFenced(CommitFailed):
    """A writer with a newer fencing token (``SaveConfig.fence``) has committed under the root:
    this writer is stale (a job that was replaced) and may not commit beside its successor."""
