"""Saving: snapshot to host buffers, persist in the background, commit a manifest.

Order of one save, on every rank (rank 0 also commits):

1. ``Checkpointer.save()`` — waits for the previous save if it is still running (or raises
   :class:`SaveInProgress`), checks the input, then copies the rank's tensors into one reusable
   host buffer (pinned when CUDA exists). This copy is the only part that holds up training.
   With ``snapshot="overlap"`` the copy itself runs in the background too, and the caller must
   call ``handle.wait_snapshot()`` before changing any saved tensor (e.g. before
   ``optimizer.step()``): forward and backward of the next step overlap the copy.
2. Background thread — cuts each tensor's bytes into chunks, checksums (xxh3 of the raw bytes)
   and maybe compresses them on a small thread pool, appends them in order to
   ``rank-NNNNN.bin``, fsyncs the file and the directory. ``SaveConfig.background_nice`` and
   ``persist_bytes_per_s`` budget this work when training keeps the host's cores busy.
3. Commit — every rank sends its shard record (file size and digest, chunk table, regions,
   metadata) to rank 0 through the :class:`~stalwart.ckpt.coord.Coordinator`, even when it
   failed. Rank 0 checks that the parts tile every tensor, writes ``manifest.json`` atomically
   (temp file, fsync, rename, fsync of the directory) only if every rank succeeded, and tells all
   ranks the outcome. Then rank 0 applies the retention policy.

Host memory: one buffer of the rank's state size, kept between saves (grown when the state
grows, freed by ``close()``), plus at most ``2 * encode_threads`` chunks being encoded and two
8 MiB write buffers. Saves never overlap, so that is the bound.

If rank 0 dies after writing the manifest and before announcing it, other ranks report
:class:`CommitTimeout` although the checkpoint is committed; a loader will use it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from stalwart.ckpt import codec, storage
from stalwart.ckpt.coord import Coordinator, default_coordinator
from stalwart.ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CommitFailed,
    CommitFenced,
    LayoutMismatch,
    SaveInProgress,
)
from stalwart.ckpt.format import (
    LOCK_NAME,
    MANIFEST_NAME,
    build_content,
    canonical_json,
    encode_manifest,
    encode_metadata,
    pack_header,
    parse_manifest,
    shard_file_name,
)
from stalwart.ckpt.layout import Region, chunk_bounds
from stalwart.ckpt.retention import RetentionPolicy, collect_garbage
from stalwart.ckpt.shard import Entry, Shard, entries_for_save
from stalwart.ckpt.writer import DirectIO, ShardWriter

log = logging.getLogger(__name__)
_ALIGN = 64


@dataclass(frozen=True)
class SaveConfig:
    """How a :class:`Checkpointer` saves. Validated on construction; unknown fields are errors."""

    chunk_bytes: int = 8 << 20
    compression: codec.CodecPolicy = field(default_factory=codec.CodecPolicy)
    encode_threads: int = 2
    commit_timeout_s: float = 600.0
    if_busy: Literal["wait", "raise"] = "wait"
    snapshot: Literal["blocking", "overlap"] = "blocking"
    retention: RetentionPolicy | None = field(default_factory=RetentionPolicy)
    max_metadata_bytes: int = 1 << 20
    direct_io: DirectIO = "auto"
    keep_committed: bool = False
    """Keep the host snapshot of the last committed save (:meth:`Checkpointer.committed_snapshot`):
    two host buffers alternate, so the next save never overwrites it. Costs a second buffer."""
    background_nice: int = 0
    """Scheduling niceness added to the background threads of a save (hashing, compression,
    writing; not the overlap snapshot copy, which the next optimizer step waits for), 0-19. On a
    host whose cores training keeps busy, the background work then runs in what training leaves
    idle instead of taking cores from it (the save takes longer). Linux only; ignored elsewhere."""
    persist_bytes_per_s: float | None = None
    """Pace the background work: chunks are hashed, compressed and written at no more than this
    many bytes per second (raw bytes), spreading a save's CPU work over the time between saves.
    ``None``: as fast as possible."""
    fence: int | None = None
    """This writer's fencing token (e.g. the job attempt or round; larger is newer). It goes into
    the manifest, and a commit is refused with :class:`CommitFenced` once a writer with a larger
    token has committed under the root (``fence.json``), so a stale job cannot commit beside its
    replacement. ``None``: no fencing."""

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= 1 << 30:
            raise ValueError(f"chunk_bytes must be in [4 KiB, 1 GiB], got {self.chunk_bytes}")
        if not 1 <= self.encode_threads <= 64:
            raise ValueError(f"encode_threads must be in [1, 64], got {self.encode_threads}")
        if self.commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be positive, got {self.commit_timeout_s}")
        if self.if_busy not in ("wait", "raise"):
            raise ValueError(f"if_busy must be 'wait' or 'raise', got {self.if_busy!r}")
        if self.snapshot not in ("blocking", "overlap"):
            raise ValueError(f"snapshot must be 'blocking' or 'overlap', got {self.snapshot!r}")
        if self.direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', got {self.direct_io!r}")
        nice = self.background_nice
        if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
            raise ValueError(f"background_nice must be an integer in [0, 19], got {self.background_nice!r}")
        rate = self.persist_bytes_per_s
        if rate is not None and not rate > 0:
            raise ValueError(f"persist_bytes_per_s must be positive or None, got {rate!r}")
        if self.max_metadata_bytes < 0:
            raise ValueError(f"max_metadata_bytes must be >= 0, got {self.max_metadata_bytes}")
        fence = self.fence
        if fence is not None and (not isinstance(fence, int) or isinstance(fence, bool) or fence < 0):
            raise ValueError(f"fence must be a non-negative integer or None, got {self.fence!r}")


@dataclass(frozen=True)
class CommittedSnapshot:
    """This rank's part of its last committed save, still in host memory: ``tensors`` maps each
    name it wrote to the region of the global tensor and a 1-D view of its elements. Valid until
    the next save after it commits (then that one is kept); read-only for the caller."""

    step: int
    tensors: dict[str, tuple[Region, torch.Tensor]]


@dataclass(frozen=True)
class CommitInfo:
    """The outcome of a committed save, as seen by one rank. Times are seconds from ``save()``."""

    step: int
    path: str
    rank: int
    world_size: int
    manifest_digest: str
    logical_bytes: int
    stored_bytes: int
    snapshot_s: float
    persist_s: float
    commit_s: float


class SaveHandle:
    """A save in flight. Thread-safe; every method may be called from any thread."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._snapshot = threading.Event()
        self._future: concurrent.futures.Future[CommitInfo] = concurrent.futures.Future()
        self._keep: CommittedSnapshot | None = None  # becomes the kept snapshot once committed
        self._keep_arena: torch.Tensor | None = None

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the saved tensors have been copied; afterwards they may change.
        Returns ``False`` if ``timeout`` passed first."""
        return self._snapshot.wait(timeout)

    def host_copy(self) -> CommittedSnapshot | None:
        """This rank's part of the save in host memory, once the snapshot is complete, before the
        commit (``keep_committed`` only; ``None`` before the snapshot, after the commit — then it
        is the checkpointer's :meth:`~Checkpointer.committed_snapshot` — or if the save failed).
        Valid until the next save starts; read-only. Why: a peer replica can be sent as
        soon as the data is copied, not only after the slower persist."""
        if not self._snapshot.is_set():
            return None
        return self._keep

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CommitInfo:
        """Wait for the commit. Raises what the save raised (:class:`CommitFailed`,
        :class:`CommitTimeout`, ...) or ``TimeoutError`` if ``timeout`` passed first."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"save of step {self.step} still running") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"save of step {self.step} still running") from None


class Checkpointer:
    """Saves one rank's state under ``root``; one instance per rank, saves never overlap.

    ``save`` must be called from one thread (the training loop), on every rank, with the same
    steps in the same order. ``on_commit`` is called on rank 0 with the :class:`CommitInfo` once
    the manifest is durable (e.g. to publish the commit record); its exceptions are logged.
    """

    def __init__(
        self,
        root: str,
        config: SaveConfig | None = None,
        coordinator: Coordinator | None = None,
        on_commit: Callable[[CommitInfo], None] | None = None,
    ) -> None:
        self.root = os.path.abspath(root)
        self.config = config or SaveConfig()
        self.coordinator = coordinator or default_coordinator(self.config.commit_timeout_s)
        self.rank = self.coordinator.rank
        self.world_size = self.coordinator.world_size
        self._on_commit = on_commit
        self._background_nice = _niceness_for(self.config.background_nice)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.config.encode_threads,
            "ckpt-encode",
            initializer=_lower_priority,
            initargs=(self._background_nice,),
        )
        self._arena: torch.Tensor | None = None
        self._other_arena: torch.Tensor | None = None  # keep_committed: the buffer not written next
        self._kept: CommittedSnapshot | None = None
        self._kept_arena: torch.Tensor | None = None
        self._inflight: SaveHandle | None = None
        self._closed = False
        self._commit_lock = threading.Lock()
        self._abandoned = False
        os.makedirs(self.root, exist_ok=True)

    # --- public -----------------------------------------------------------------------------

    def save(
        self, step: int, state: Mapping[str, torch.Tensor | Shard], metadata: Mapping[str, Any] | None = None
    ) -> SaveHandle:
        """Start saving ``state`` (name -> tensor or :class:`Shard`) and this rank's ``metadata``
        (JSON-safe values and bytes) as ``step``. Returns once the snapshot is taken (or, with
        ``snapshot="overlap"``, started). Raises :class:`LayoutMismatch` on bad input,
        :class:`CheckpointExists` if ``step`` is committed already, :class:`SaveInProgress`
        (``if_busy="raise"``). Failures after it returns are reported by the handle."""
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        started = time.perf_counter()
        self._wait_previous()
        if storage.is_committed(self.root, step):
            raise CheckpointExists(f"step {step} is already committed under {self.root}")
        entries = entries_for_save(state, self.rank, self.world_size)
        meta = encode_metadata(dict(metadata or {}))
        if len(canonical_json(meta)) > self.config.max_metadata_bytes:
            raise LayoutMismatch(f"metadata is larger than max_metadata_bytes={self.config.max_metadata_bytes}")
        handle = SaveHandle(step)
        views = self._stage(entries)
        arena = self._arena  # the persist thread owns this buffer until the save is done
        uses_cuda = any(e.tensor.is_cuda for e in entries)
        copy_event = None
        if self.config.snapshot == "blocking" or uses_cuda:
            copy_event = self._copy(entries, views, uses_cuda)
            if self.config.snapshot == "blocking":
                if copy_event is not None:
                    copy_event.synchronize()
                handle._snapshot.set()
        snapshot_s = time.perf_counter() - started
        log.debug("step %d rank %d: snapshot started in %.3fs", step, self.rank, snapshot_s)
        self._inflight = handle
        if self.config.keep_committed:
            handle._keep = CommittedSnapshot(step, {e.name: (e.region, v) for e, v in zip(entries, views, strict=True)})
            handle._keep_arena = self._arena
        worker = threading.Thread(
            target=self._persist,
            args=(handle, arena, entries, views, meta, copy_event, started, snapshot_s),
            name=f"ckpt-persist-{step}",
        )
        worker.start()
        return handle

    def committed_snapshot(self) -> CommittedSnapshot | None:
        """The host copy of this rank's part of the last committed save (``keep_committed``)."""
        return self._kept

    def claim_fence(self) -> None:
        """Record this writer's fencing token under the root now, before it saves anything: a
        writer with an older token (the workers of a round that the job has left behind) can no
        longer commit from this moment, not only after this one's first commit. Call it on one
        rank when a world forms. Raises :class:`CommitFenced` when a newer token is recorded
        (this writer is the stale one). A storage that cannot take the claim now (full, read-only
        for a moment) is logged, not raised: a world must form even while no checkpoint can be
        written, and the first commit records the token anyway."""
        fence = self.config.fence
        if fence is None:
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            with storage.root_commit_lock(self.root):
                seen = storage.read_fence(self.root)
                if seen is not None and seen > fence:
                    raise CommitFenced(f"{self.root}: a writer with fence {seen} claimed this root; this one has "
                                       f"{fence} (a stale world; if the root was reused by a new job, remove "
                                       f"{storage.FENCE_NAME} there)")
                if seen != fence:
                    storage.write_fence(self.root, fence)
        except OSError as exc:
            log.warning("%s: cannot record fence %d now (%s); the first commit records it", self.root, fence, exc)

    def inflight(self) -> SaveHandle | None:
        """The handle of the save still persisting or committing, or ``None`` when none is."""
        handle = self._inflight
        return None if handle is None or handle.done() else handle

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        """Wait for the save in flight (if any) and return its result; raises what it raised."""
        handle = self._inflight
        return None if handle is None else handle.result(timeout)

    def close(self) -> None:
        """Wait for the save in flight to finish with the data it was given (errors are logged,
        not raised), then release the host buffers and threads."""
        if self._closed:
            return
        self._closed = True
        handle = self._inflight
        if handle is not None:
            exc = handle.exception()
            if exc is not None:
                log.warning("step %d rank %d: last save failed: %s", handle.step, self.rank, exc)
        self._arena = self._other_arena = None
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- snapshot ---------------------------------------------------------------------------

    def _wait_previous(self) -> None:
        prev = self._inflight
        if prev is None or prev.done():
            return
        if self.config.if_busy == "raise":
            raise SaveInProgress(f"save of step {prev.step} is still persisting")
        log.info("rank %d: waiting for the save of step %d before the next one", self.rank, prev.step)
        prev.exception()  # errors belong to that save's handle

    def _stage(self, entries: list[Entry]) -> list[torch.Tensor]:
        """Typed views into the reusable host buffer, one per entry (64-byte aligned)."""
        offsets = []
        total = 0
        for e in entries:
            offsets.append(total)
            total += (e.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        pin = torch.cuda.is_available()
        if self._kept is not None and self._arena is self._kept_arena:
            self._arena, self._other_arena = self._other_arena, self._arena  # leave the kept one alone
        if self._arena is None or self._arena.numel() < total or self._arena.is_pinned() != pin:
            self._arena = None
            self._arena = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
            log.info("rank %d: host buffer of %d bytes (pinned=%s)", self.rank, total, pin)
        return [
            self._arena[off : off + e.nbytes].view(e.tensor.dtype) for off, e in zip(offsets, entries, strict=True)
        ]

    @staticmethod
    def _copy(entries: list[Entry], views: list[torch.Tensor], uses_cuda: bool) -> Any:
        """Copy every entry into its view; with CUDA on a side stream, returning its event."""
        if not uses_cuda:
            for e, v in zip(entries, views, strict=True):
                if e.region.numel:
                    v.view(e.tensor.shape).copy_(e.tensor)
            return None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for e, v in zip(entries, views, strict=True):
                if e.region.numel:
                    v.view(e.tensor.shape).copy_(e.tensor, non_blocking=True)
            return stream.record_event()

    # --- persist and commit (background thread) --------------------------------------------

    def _persist(
        self,
        handle: SaveHandle,
        arena: torch.Tensor | None,
        entries: list[Entry],
        views: list[torch.Tensor],
        meta: Any,
        copy_event: Any,
        started: float,
        snapshot_s: float,
    ) -> None:
        step = handle.step
        step_dir = storage.step_path(self.root, step)
        record: dict[str, Any] = {"rank": self.rank}
        local_error: BaseException | None = None
        persist_s = 0.0
        failed: CheckpointError | None = None
        with contextlib.ExitStack() as stack:
            try:
                storage.ensure_step_dir(self.root, step)
                stack.enter_context(storage.shared_lock(step_dir, create=True))
                copy_here = None
                if not handle._snapshot.is_set():
                    if copy_event is None:
                        copy_here = handle  # overlap on CPU: copy each tensor just before its chunks
                    else:
                        copy_event.synchronize()
                        handle._snapshot.set()
                record.update(self._write_shard(step, step_dir, arena, entries, views, copy_here))
                record["metadata"] = meta
                persist_s = time.perf_counter() - started
            except Exception as exc:
                local_error = exc
                record["error"] = f"{type(exc).__name__}: {exc}"
                log.error("step %d rank %d: persisting the shard failed: %s", step, self.rank, exc)
            finally:
                handle._snapshot.set()
            # Every rank takes part in the commit, failed or not, so no rank waits in vain.
            try:
                info = self._commit(step, step_dir, record, local_error, started, snapshot_s, persist_s)
            except _Refused as refused:
                # Known not committed by us: remove what this save wrote (a full disk must not stay full).
                self._discard(step_dir, record)
                failed = refused.error
            except CheckpointError as exc:  # the outcome is unknown (rank 0 may have committed): keep the file
                handle._future.set_exception(exc)
                return
            except Exception as exc:
                failure = CommitFailed(f"step {step}: {type(exc).__name__}: {exc}")
                failure.__cause__ = exc
                handle._future.set_exception(failure)
                return
        if failed is not None:
            if self.rank == 0:
                self._remove_if_empty(step_dir)
            handle._future.set_exception(failed)  # after the clean-up: a caller sees it done
            return
        if handle._keep is not None:
            self._kept, self._kept_arena = handle._keep, handle._keep_arena
        handle._keep = handle._keep_arena = None
        if self.rank == 0:
            self._after_commit(info)
        handle._future.set_result(info)

    def _discard(self, step_dir: str, record: dict[str, Any]) -> None:
        file = record.get("file")
        if file is None:
            return  # nothing written, or the writer already removed its partial file
        try:
            os.unlink(os.path.join(step_dir, file["name"]))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("rank %d: cannot remove %s of a failed save: %s", self.rank, file["name"], exc)

    def _remove_if_empty(self, step_dir: str) -> None:
        """Rank 0, after a failed save: remove the step directory if nothing but its lock is left
        (another writer's files or a committed manifest keep it)."""
        try:
            if os.path.islink(step_dir):
                return  # never ours: the save refused to write through it
            if set(os.listdir(step_dir)) <= {LOCK_NAME}:
                storage.remove_step_dir(self.root, step_dir)
        except OSError as exc:
            log.debug("cannot remove %s: %s", step_dir, exc)

    def _write_shard(
        self,
        step: int,
        step_dir: str,
        arena: torch.Tensor | None,
        entries: list[Entry],
        views: list[torch.Tensor],
        copy: SaveHandle | None,
    ) -> dict[str, Any]:
        """Write this rank's shard file from ``arena`` (the buffer this save staged into). With
        ``copy``, a helper thread snapshots the tensors one after another (marking ``copy`` when
        all are done) while the chunks of tensors already copied are encoded and written."""
        policy = self.config.compression
        arena_bytes = memoryview(arena.numpy()) if arena is not None else memoryview(b"")
        base = arena.data_ptr() if arena is not None else 0
        ready = [threading.Event() for _ in entries]
        copy_errors: list[BaseException] = []

        def copier(handle: SaveHandle) -> None:
            try:
                for e, v, event in zip(entries, views, ready, strict=True):
                    if e.region.numel:
                        v.view(e.tensor.shape).copy_(e.tensor)
                    event.set()
            except BaseException as exc:
                copy_errors.append(exc)
            finally:
                for event in ready:
                    event.set()
                handle._snapshot.set()

        if copy is not None:
            threading.Thread(target=copier, args=(copy,), name=f"ckpt-snapshot-{step}", daemon=True).start()
        else:
            for event in ready:
                event.set()
        _lower_priority(self._background_nice)  # after the copier started: it must not inherit it
        rate = self.config.persist_bytes_per_s
        paced_from = time.perf_counter()
        paced_bytes = 0

        def jobs() -> Iterator[tuple[int, memoryview]]:
            nonlocal paced_bytes
            for index, (e, v) in enumerate(zip(entries, views, strict=True)):
                ready[index].wait()
                start = v.data_ptr() - base if e.region.numel else 0
                size = e.tensor.element_size()
                for lo, hi in chunk_bounds(e.region.numel, size, self.config.chunk_bytes):
                    if rate is not None:
                        ahead = paced_from + paced_bytes / rate - time.perf_counter()
                        if ahead > 0:
                            time.sleep(ahead)
                        paced_bytes += (hi - lo) * size
                    yield index, arena_bytes[start + lo * size : start + hi * size]

        tensors: dict[str, Any] = {
            e.name: {"dtype": e.dtype, "shape": list(e.region.shape), "region": e.region.to_json(), "chunks": []}
            for e in entries
        }
        name = shard_file_name(self.rank)
        try:
            out = ShardWriter(os.path.join(step_dir, name), self.config.direct_io)
        except FileExistsError:  # a crashed or concurrent save of this step: write a file of our own
            name = shard_file_name(self.rank, uuid.uuid4().hex[:12])
            out = ShardWriter(os.path.join(step_dir, name), self.config.direct_io)
        try:
            out.write(pack_header(self.rank, self.world_size, step))
            window = 2 * self.config.encode_threads
            pending: collections.deque[tuple[int, int, concurrent.futures.Future[Any]]] = collections.deque()
            queue = jobs()
            for index, raw in itertools.islice(queue, window):
                pending.append((index, len(raw), self._pool.submit(codec.encode, raw, policy)))
            while pending:
                index, raw_size, future = pending.popleft()
                kind, stored, digest = future.result()
                for index_next, raw in itertools.islice(queue, 1):
                    pending.append((index_next, len(raw), self._pool.submit(codec.encode, raw, policy)))
                tensors[entries[index].name]["chunks"].append([out.size, len(stored), raw_size, kind, digest])
                out.write(stored)
            if copy_errors:
                raise copy_errors[0]
            written = sum(c[2] for t in tensors.values() for c in t["chunks"])
            expected = sum(e.nbytes for e in entries)
            if written != expected:
                raise CommitFailed(f"wrote {written} bytes of a state of {expected}")
            size, file_digest = out.finish()
        except BaseException:
            out.abort()
            raise
        storage.fsync_dir(step_dir)
        return {"file": {"name": name, "rank": self.rank, "size": size, "digest": file_digest}, "tensors": tensors}

    def _commit(
        self,
        step: int,
        step_dir: str,
        record: dict[str, Any],
        local_error: BaseException | None,
        started: float,
        snapshot_s: float,
        persist_s: float,
    ) -> CommitInfo:
        coord = self.coordinator
        timeout = self.config.commit_timeout_s
        payloads = coord.gather(canonical_json(record), timeout)
        if coord.rank == 0:
            assert payloads is not None
            outcome = self._write_manifest(step, step_dir, payloads)
            coord.broadcast(canonical_json(outcome), timeout)
        else:
            outcome = json.loads(coord.broadcast(None, timeout))
        if not outcome.get("ok"):
            kind = {"exists": CheckpointExists, "fenced": CommitFenced}.get(outcome.get("kind", ""), CommitFailed)
            error = kind(f"step {step} not committed: {outcome.get('error')}")
            error.__cause__ = local_error
            raise _Refused(error)
        commit_s = time.perf_counter() - started
        file = record["file"]
        logical = sum(c[2] for t in record["tensors"].values() for c in t["chunks"])
        log.info(
            "step %d rank %d: committed %d bytes (%d stored) in %.3fs (snapshot %.3fs)",
            step, self.rank, logical, file["size"], commit_s, snapshot_s,
        )  # fmt: skip
        return CommitInfo(
            step=step,
            path=step_dir,
            rank=self.rank,
            world_size=self.world_size,
            manifest_digest=outcome["digest"],
            logical_bytes=logical,
            stored_bytes=file["size"],
            snapshot_s=snapshot_s,
            persist_s=persist_s,
            commit_s=commit_s,
        )

    def abandon(self) -> None:
        """The world this checkpointer commits in is gone (a re-form): a save still in flight must
        never commit. When this returns, its manifest is either durable already or never will be,
        so a restore that lists checkpoints afterwards sees the final state."""
        with self._commit_lock:
            self._abandoned = True

    def _write_manifest(self, step: int, step_dir: str, payloads: list[bytes]) -> dict[str, Any]:
        """Rank 0: build, check and durably write the manifest if every rank succeeded. The
        manifest is parsed back with the loader's own checks first, so nothing is committed that
        cannot be loaded; it is created exclusively, so a second writer of the step is refused."""
        fence = self.config.fence
        try:
            records = [json.loads(p) for p in payloads]
            errors = [f"rank {r.get('rank')}: {r['error']}" for r in records if "error" in r]
            if errors:
                return {"ok": False, "error": "; ".join(errors)}
            content = build_content(
                step, self.world_size, time.time(), records, fence=fence, attempt=uuid.uuid4().hex
            )
            data, digest = encode_manifest(content)
            parse_manifest(data)
            with storage.root_commit_lock(self.root):
                seen = storage.read_fence(self.root) if fence is not None else None
                if fence is not None and seen is not None and seen > fence:
                    return {
                        "ok": False,
                        "kind": "fenced",
                        "error": f"a writer with fence {seen} committed under this root; this one has {fence}",
                    }
                with self._commit_lock:
                    if self._abandoned:
                        return {"ok": False, "error": "abandoned: the world that saved it changed before the commit"}
                    storage.create_exclusive(step_dir, MANIFEST_NAME, data)
                if fence is not None and (seen is None or fence > seen):
                    try:
                        storage.write_fence(self.root, fence)
                    except OSError as exc:  # committed all the same; the next commit records it
                        log.warning("step %d rank 0: cannot record fence %d: %s", step, fence, exc)
        except CheckpointExists as exc:
            log.error("step %d rank 0: not committed: %s", step, exc)
            return {"ok": False, "kind": "exists", "error": str(exc)}
        except Exception as exc:
            log.error("step %d rank 0: cannot commit: %s", step, exc)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "digest": digest}

    def _after_commit(self, info: CommitInfo) -> None:
        if self._on_commit is not None:
            try:
                self._on_commit(info)
            except Exception:
                log.exception("step %d rank 0: on_commit callback failed", info.step)
        policy = self.config.retention
        if policy is not None:
            try:
                collect_garbage(self.root, policy, protect={info.step})
            except Exception:
                log.exception("step %d rank 0: retention failed", info.step)


def _niceness_for(added: int) -> int | None:
    """The niceness for background threads: the calling thread's plus ``added`` (``None``: leave
    them as they are)."""
    if added <= 0 or not hasattr(os, "getpriority"):
        return None
    try:
        return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + added)
    except OSError:
        return None


def _lower_priority(niceness: int | None) -> None:
    """Set the calling thread's niceness to ``niceness`` unless it is that nice already (Linux:
    niceness is per thread and the threads it starts inherit it). Best effort."""
    if niceness is None:
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError as exc:
        log.debug("cannot lower the priority of a checkpoint thread: %s", exc)


class _Refused(Exception):
    """The commit is known not to have happened (rank 0 said so); carries the error to report."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error
