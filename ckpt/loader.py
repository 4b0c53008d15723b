"""Loading: the newest committed checkpoint that verifies, read at any world size.

Order of a load, on every rank of the loading world (which need not be the saving world):

1. Rank 0 lists the committed steps, newest first, and tells every rank (so all try the same).
2. For each candidate, every rank takes the directory's lock shared (gc cannot remove it), reads
   and checks the manifest, plans which chunks its targets need (``layout.plan_reads``), checks
   the size and header of each shard file it touches, then reads those chunks in parallel,
   verifying each chunk's checksum before copying its elements into the targets.
3. The ranks agree through the coordinator: if any rank found the candidate corrupt, all of them
   skip it (logging why) and try the next older one, so every rank ends on the same step.

A request that cannot fit any checkpoint (unknown tensor, other dtype or shape) raises
:class:`LayoutMismatch` at once on every rank. If the load fails, the targets' contents are
unspecified (they may hold part of a skipped checkpoint).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.ckpt import codec, storage
from stalwart.ckpt.coord import Coordinator, default_coordinator
from stalwart.ckpt.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    LayoutMismatch,
    UnsupportedFormat,
)
from stalwart.ckpt.format import HEADER_SIZE, Manifest, check_header
from stalwart.ckpt.layout import ChunkRead, apply_copies, plan_reads
from stalwart.ckpt.shard import Entry, Shard, entries_for_load

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What was loaded. ``metadata[r]`` is what rank ``r`` of the *saving* world stored;
    ``skipped`` lists newer checkpoints passed over, as ``(step, reason)``."""

    step: int
    world_size: int
    metadata: list[dict[str, Any]]
    manifest_digest: str
    bytes_read: int
    skipped: list[tuple[int, str]] = field(default_factory=list)


class _Fatal(Exception):
    """The request does not fit; carries the error to raise on every rank."""


def load(
    root: str,
    targets: Mapping[str, torch.Tensor | Shard],
    *,
    step: int | None = None,
    max_step: int | None = None,
    coordinator: Coordinator | None = None,
    io_threads: int = 4,
    timeout_s: float = 600.0,
    read_bytes_per_s: float | None = None,
) -> LoadResult:
    """Fill ``targets`` (name -> tensor or :class:`Shard`, in place) from the newest good checkpoint.

    With ``step`` only that checkpoint is tried, and its error is raised. With ``max_step`` the
    newest good one at or below it is loaded (a rollback to before a bad step). Every rank of a
    world must call ``load`` with the same ``root``, ``step`` and ``max_step``: like saving, the default coordinator
    is torch.distributed when a process group is initialized (a collective call, as DCP's load),
    else a world of one. Pass ``SingleCoordinator()`` to load in one process alone. Raises
    :class:`CheckpointNotFound` when no checkpoint could be loaded, :class:`LayoutMismatch` when
    the request does not fit, and, with ``step``, :class:`CheckpointCorrupt` /
    :class:`UnsupportedFormat`.

    ``read_bytes_per_s``: this call's budget for reading chunks (``None``: as fast as storage
    goes), so that the restores of a whole world at once do not saturate a shared file system.
    """
    if io_threads < 1:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    if read_bytes_per_s is not None and read_bytes_per_s <= 0:
        raise ValueError(f"read_bytes_per_s must be positive or None, got {read_bytes_per_s}")
    pace = _Pace(read_bytes_per_s) if read_bytes_per_s is not None else None
    coord = coordinator or default_coordinator(timeout_s)
    entries = entries_for_load(targets)
    if coord.rank == 0:
        candidates = [step] if step is not None else storage.committed_steps(root)
        if max_step is not None:
            candidates = [c for c in candidates if c <= max_step]
        coord.broadcast(json.dumps(candidates).encode(), timeout_s)
    else:
        candidates = json.loads(coord.broadcast(None, timeout_s))
    skipped: list[tuple[int, str]] = []
    for candidate in candidates:
        local: Exception | None = None
        result: LoadResult | None = None
        try:
            result = _load_step(root, candidate, entries, io_threads, pace)
            verdict = {"ok": True}
        except _Fatal as exc:
            local = exc.args[0]
            verdict = {"fatal": str(local)}
        except (CheckpointCorrupt, UnsupportedFormat, CheckpointNotFound) as exc:
            local = exc
            verdict = {"skip": f"{type(exc).__name__}: {exc}"}
        decision = _agree(coord, verdict, timeout_s)
        if decision.get("ok"):
            assert result is not None
            log.info("rank %d: loaded step %d (saved by %d ranks)", coord.rank, candidate, result.world_size)
            return LoadResult(
                result.step, result.world_size, result.metadata, result.manifest_digest, result.bytes_read, skipped
            )
        if "fatal" in decision:
            if isinstance(local, CheckpointError) and "fatal" in verdict:
                raise local
            raise LayoutMismatch(f"another rank cannot load step {candidate}: {decision['fatal']}")
        reason = decision["skip"]
        if step is not None:
            if local is not None:
                raise local
            raise CheckpointCorrupt(f"another rank: {reason}")
        log.warning("rank %d: skipping checkpoint step %d: %s", coord.rank, candidate, reason)
        skipped.append((candidate, reason))
    raise CheckpointNotFound(
        f"no loadable checkpoint under {root}" + (f" (skipped: {skipped})" if skipped else "")
    )


def _agree(coord: Coordinator, verdict: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Rank 0 combines every rank's verdict: any fatal wins, then any skip, else ok."""
    gathered = coord.gather(json.dumps(verdict).encode(), timeout_s)
    if coord.rank != 0:
        return json.loads(coord.broadcast(None, timeout_s))
    assert gathered is not None
    verdicts = [json.loads(v) for v in gathered]
    decision: dict[str, Any] = {"ok": True}
    for rank, v in enumerate(verdicts):
        if "fatal" in v:
            decision = {"fatal": f"rank {rank}: {v['fatal']}"}
            break
        if "skip" in v and "skip" not in decision:
            decision = {"skip": f"rank {rank}: {v['skip']}" if coord.world_size > 1 else v["skip"]}
    coord.broadcast(json.dumps(decision).encode(), timeout_s)
    return decision


@dataclass
class _Target:
    entry: Entry
    flat: torch.Tensor  # 1-D CPU buffer the copies write into
    reads: list[ChunkRead]
    staged: bool  # flat is a temporary, copied into the target at the end


class _Pace:
    """A budget of ``rate`` bytes/s shared by the read threads: each read waits for its turn."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, n: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self._free_at = max(self._free_at, now) + n / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


def _paced_read(pace: _Pace | None, *args: Any) -> int:
    n = _read_chunk(*args)
    if pace is not None:
        pace.take(n)
    return n


def _load_step(root: str, step: int, entries: list[Entry], io_threads: int, pace: _Pace | None = None) -> LoadResult:
    step_dir = storage.step_path(root, step)
    with storage.shared_lock(step_dir, create=False):
        manifest = storage.read_manifest(root, step)
        targets = [_plan(manifest, e) for e in entries]
        with contextlib.ExitStack() as stack:
            fds = _open_files(manifest, step_dir, targets, stack)
            numbers = chunk_numbers(manifest)
            tasks = [(t, read) for t in targets for read in t.reads]
            with concurrent.futures.ThreadPoolExecutor(io_threads, "ckpt-read") as pool:
                futures = [pool.submit(_paced_read, pace, manifest, fds, numbers, t, read) for t, read in tasks]
                try:
                    bytes_read = sum(f.result() for f in futures)
                finally:
                    for f in futures:
                        f.cancel()
        for t in targets:
            if t.staged:
                t.entry.tensor.copy_(t.flat.view(t.entry.tensor.shape))
    return LoadResult(step, manifest.world_size, manifest.metadata, manifest.digest, bytes_read)


def _plan(manifest: Manifest, entry: Entry) -> _Target:
    record = manifest.tensors.get(entry.name)
    if record is None:
        raise _Fatal(LayoutMismatch(f"step {manifest.step} has no tensor {entry.name!r}"))
    if record.dtype != entry.dtype or record.shape != entry.region.shape:
        raise _Fatal(
            LayoutMismatch(
                f"{entry.name!r}: saved as {record.dtype}{list(record.shape)}, "
                f"requested {entry.dtype}{list(entry.region.shape)}"
            )
        )
    reads, covered = plan_reads(record.saved_parts(), entry.region)
    if covered != entry.region.numel:
        raise CheckpointCorrupt(f"parts of {entry.name!r} cover {covered} of {entry.region.numel} elements")
    t = entry.tensor
    staged = not (t.device.type == "cpu" and t.is_contiguous())
    flat = torch.empty(entry.region.numel, dtype=t.dtype) if staged else t.view(-1)
    return _Target(entry, flat, reads, staged)


def _open_files(
    manifest: Manifest, step_dir: str, targets: list[_Target], stack: contextlib.ExitStack
) -> dict[str, int]:
    """Open every file the reads touch; check its size and header. Raises CheckpointCorrupt."""
    names = sorted({manifest.tensors[t.entry.name].parts[r.part].file for t in targets for r in t.reads})
    fds: dict[str, int] = {}
    for name in names:
        record = manifest.files[name]
        try:
            fd = storage.open_regular(os.path.join(step_dir, name))
        except FileNotFoundError:
            raise CheckpointCorrupt("shard file is missing", file=name) from None
        except OSError as exc:
            raise CheckpointCorrupt(f"cannot open shard file ({exc})", file=name) from exc
        stack.callback(os.close, fd)
        size = os.fstat(fd).st_size
        if size != record.size:
            raise CheckpointCorrupt(f"file has {size} bytes, manifest says {record.size}", file=name)
        header = os.pread(fd, HEADER_SIZE, 0)
        check_header(header, file=name, rank=record.rank, world_size=manifest.world_size, step=manifest.step)
        fds[name] = fd
    return fds


def chunk_numbers(manifest: Manifest) -> dict[tuple[str, int], int]:
    """``(file, offset) -> n``: the chunk's position among all chunks of its file (as in errors)."""
    by_file: dict[str, list[int]] = {}
    for t in manifest.tensors.values():
        for p in t.parts:
            by_file.setdefault(p.file, []).extend(c.offset for c in p.chunks)
    return {(f, off): n for f, offsets in by_file.items() for n, off in enumerate(sorted(offsets))}


def _read_chunk(
    manifest: Manifest, fds: dict[str, int], numbers: dict[tuple[str, int], int], target: _Target, read: ChunkRead
) -> int:
    part = manifest.tensors[target.entry.name].parts[read.part]
    chunk = part.chunks[read.chunk]
    number = numbers[(part.file, chunk.offset)]
    buf = bytearray(chunk.stored)
    view = memoryview(buf)
    got = 0
    while got < chunk.stored:
        n = os.preadv(fds[part.file], [view[got:]], chunk.offset + got)
        if n <= 0:
            raise CheckpointCorrupt("file ends inside the chunk", file=part.file, chunk=number)
        got += n
    data = codec.decode(buf, chunk.codec, chunk.raw, chunk.digest, file=part.file, chunk=number)
    if not isinstance(data, bytearray):
        data = bytearray(data)
    src = torch.frombuffer(data, dtype=torch.uint8).view(target.flat.dtype)
    apply_copies(read.copies, src, target.flat)
    return chunk.stored
