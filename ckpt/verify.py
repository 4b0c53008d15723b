"""Full verification and inspection of a checkpoint (what ``stalwart ckpt verify/inspect`` run).

:func:`verify` reads every byte of every file once: header, each chunk (decoded and checked against
its digest) and the whole-file digest, and reports every problem it finds instead of stopping at
the first. A checkpoint that passes is marked (``verified.json``), and retention never removes the
newest marked checkpoint; one that fails loses its mark.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from stalwart.ckpt import codec, storage
from stalwart.ckpt.errors import CheckpointCorrupt, CheckpointError, UnsupportedFormat
from stalwart.ckpt.format import HEADER_SIZE, ChunkRecord, Manifest, check_header

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]


@dataclass
class VerifyReport:
    """``problems`` holds one exception per defect (CheckpointCorrupt names file and chunk)."""

    step: int
    problems: list[CheckpointError] = field(default_factory=list)
    bytes_checked: int = 0
    files_checked: int = 0
    manifest_digest: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(root: str, step: int, *, progress: Progress | None = None, mark: bool = True) -> VerifyReport:
    """Check every byte of checkpoint ``step``. Raises :class:`CheckpointNotFound` if it does not
    exist (or is not committed); every other defect is reported in the returned report.
    ``progress(done_bytes, total_bytes)`` is called after each chunk."""
    step_dir = storage.step_path(root, step)
    report = VerifyReport(step)
    try:
        with storage.shared_lock(step_dir, create=False):
            manifest = _verify_locked(root, step, step_dir, report, progress)
    except CheckpointCorrupt as exc:  # the lock itself (a planted link): nothing could be read safely
        report.problems.append(exc)
        manifest = None
    if report.ok and mark and manifest is not None:
        try:
            storage.mark_verified(step_dir, manifest.digest)
        except OSError as exc:  # e.g. a read-only copy: the verify itself still counts
            log.warning("verify step %d: cannot record the result (%s)", step, exc)
    elif not report.ok:
        _clear_mark(step_dir, step)
    for p in report.problems:
        log.warning("verify step %d: %s", step, p)
    return report


def _verify_locked(
    root: str, step: int, step_dir: str, report: VerifyReport, progress: Progress | None
) -> Manifest | None:
    try:
        manifest = storage.read_manifest(root, step)
    except (CheckpointCorrupt, UnsupportedFormat) as exc:
        report.problems.append(exc)
        return None
    report.manifest_digest = manifest.digest  # the manifest passed the loader's structural checks
    total = manifest.stored_bytes
    done = 0
    for name in sorted(manifest.files):
        done = _verify_file(manifest, step_dir, name, report, progress, done, total)
        report.files_checked += 1
    return manifest


def _clear_mark(step_dir: str, step: int) -> None:
    """A failed verify withdraws an earlier success: retention and ``ckpt list`` must not keep
    trusting a checkpoint that no longer reads back."""
    try:
        storage.clear_verified(step_dir)
    except OSError as exc:
        log.warning("verify step %d: cannot clear the verified mark (%s)", step, exc)


def _file_chunks(manifest: Manifest, name: str) -> list[ChunkRecord]:
    chunks = [c for t in manifest.tensors.values() for p in t.parts if p.file == name for c in p.chunks]
    return sorted(chunks, key=lambda c: c.offset)


def _verify_file(
    manifest: Manifest,
    step_dir: str,
    name: str,
    report: VerifyReport,
    progress: Progress | None,
    done: int,
    total: int,
) -> int:
    record = manifest.files[name]
    problems = report.problems
    try:
        fd = storage.open_regular(os.path.join(step_dir, name))
    except OSError as exc:
        problems.append(CheckpointCorrupt(f"shard file cannot be opened ({exc.strerror})", file=name))
        return done + record.size
    try:
        size = os.fstat(fd).st_size
        if size != record.size:
            problems.append(CheckpointCorrupt(f"file has {size} bytes, manifest says {record.size}", file=name))
        hasher = xxhash.xxh3_128()
        header = os.pread(fd, HEADER_SIZE, 0)
        hasher.update(header)
        try:
            check_header(header, file=name, rank=record.rank, world_size=manifest.world_size, step=manifest.step)
        except CheckpointError as exc:
            problems.append(exc)
        pos = HEADER_SIZE
        for number, chunk in enumerate(_file_chunks(manifest, name)):
            if chunk.offset != pos:
                problems.append(CheckpointCorrupt(f"chunk at {chunk.offset}, expected {pos}", file=name, chunk=number))
            data = os.pread(fd, chunk.stored, chunk.offset)
            hasher.update(data)
            pos = chunk.offset + len(data)
            if len(data) != chunk.stored:
                problems.append(CheckpointCorrupt("file ends inside the chunk", file=name, chunk=number))
            else:
                try:
                    codec.decode(data, chunk.codec, chunk.raw, chunk.digest, file=name, chunk=number)
                except CheckpointError as exc:
                    problems.append(exc)
            report.bytes_checked += len(data)
            if progress is not None:
                progress(done + pos, total)
        if pos != record.size:
            problems.append(CheckpointCorrupt(f"chunks end at {pos}, file should end at {record.size}", file=name))
        elif size == record.size and hasher.hexdigest() != record.digest:
            problems.append(CheckpointCorrupt("whole-file digest mismatch", file=name))
    finally:
        os.close(fd)
    return done + record.size


def inspect(root: str, step: int) -> dict[str, Any]:
    """A JSON-safe summary of checkpoint ``step``: tensors, layouts, sizes, compression ratio.
    Raises what :func:`~stalwart.ckpt.storage.read_manifest` raises."""
    manifest = storage.read_manifest(root, step)
    tensors = []
    for name, t in sorted(manifest.tensors.items()):
        raw = sum(c.raw for p in t.parts for c in p.chunks)
        stored = sum(c.stored for p in t.parts for c in p.chunks)
        tensors.append(
            {
                "name": name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "raw_bytes": raw,
                "stored_bytes": stored,
                "parts": [
                    {
                        "rank": p.rank,
                        "file": p.file,
                        "region": p.region.to_json(),
                        "chunks": len(p.chunks),
                        "compressed_chunks": sum(c.codec != "raw" for c in p.chunks),
                    }
                    for p in t.parts
                ],
            }
        )
    logical = manifest.logical_bytes
    stored = sum(c.stored for t in manifest.tensors.values() for p in t.parts for c in p.chunks)
    return {
        "step": manifest.step,
        "world_size": manifest.world_size,
        "format_version": "{}.{}".format(*manifest.version),
        "created_unix": manifest.created_unix,
        "manifest_digest": manifest.digest,
        "files": {n: {"rank": f.rank, "size": f.size, "digest": f.digest} for n, f in sorted(manifest.files.items())},
        "logical_bytes": logical,
        "stored_bytes": stored,
        "file_bytes": manifest.stored_bytes,
        "compression_ratio": (logical / stored) if stored else 1.0,
        "tensors": tensors,
        "metadata_keys": [sorted(m) for m in manifest.metadata],
    }
