"""Prefix watches that survive disconnects and etcd restarts without losing or repeating events.

The watch remembers the next revision it owes the caller. After any stream failure it reopens
the stream at that revision (on another member if needed), and drops anything older, so each
event reaches the caller exactly once and in revision order. etcd's progress notifications
advance that revision while the prefix is quiet, which keeps a resume inside etcd's history.
If the history has been compacted past it, the caller gets :class:`CompactedError` and should
re-read the prefix and start a new watch from the read's revision.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import grpc
from pyetcd import etcdrpc

from stalwart.coord.client import EtcdClient, prefix_end
from stalwart.coord.errors import CompactedError, CoordError, EtcdUnavailable

log = logging.getLogger(__name__)


class EventType(Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


class Watch:
    """Watch every key under ``prefix`` from ``start_revision`` (0: from now on).

    Events arrive in batches (all events of one etcd revision stay in one batch). Read them
    with :meth:`get` or by iterating. A failure the watch cannot recover from (compaction,
    permission) is raised from :meth:`get` once, and the watch ends. Call :meth:`close` when done.
    """

    def __init__(self, client: EtcdClient, prefix: str, start_revision: int = 0) -> None:
        self._client = client
        self.prefix = prefix
        self._next_revision = start_revision
        self._queue: queue.Queue[list[WatchEvent] | BaseException | None] = queue.Queue()
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._stream: grpc.Call | None = None
        self._end: threading.Event | None = None
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"etcd-watch {prefix}")
        self._thread.start()

    @property
    def next_revision(self) -> int:
        """The revision from which events are still owed to the caller."""
        return self._next_revision

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first stream is established (events from then on are not missed)."""
        return self._ready.wait(timeout)

    def get(self, timeout: float | None = None) -> list[WatchEvent]:
        """The next batch of events; ``[]`` when none came within ``timeout`` or the watch is closed."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if item is None:
            self._queue.put(None)  # keep the end marker for other readers
            return []
        if isinstance(item, BaseException):
            self._queue.put(None)
            raise item
        return item

    def __iter__(self) -> Iterator[WatchEvent]:
        """Events until the watch is closed (or fails: the error is raised)."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._closed.is_set():
                    return
                continue
            if item is None:
                self._queue.put(None)
                return
            if isinstance(item, BaseException):
                self._queue.put(None)
                raise item
            yield from item

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._end is not None:
                self._end.set()
            if self._stream is not None:
                self._stream.cancel()
        self._thread.join(timeout=5)
        self._queue.put(None)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the watch thread --------------------------------------------------------------------

    def _request(self) -> etcdrpc.WatchRequest:
        create = etcdrpc.WatchCreateRequest(
            key=self.prefix.encode(),
            range_end=prefix_end(self.prefix),
            start_revision=self._next_revision,
            progress_notify=True,
        )
        return etcdrpc.WatchRequest(create_request=create)

    def _run(self) -> None:
        delay = 0.05
        while not self._closed.is_set():
            try:
                stream, first, conn, end = self._client.open_watch(self._request())
            except EtcdUnavailable as exc:
                log.warning("watch %s: etcd unavailable, retrying: %s", self.prefix, exc)
                self._closed.wait(delay)
                delay = min(delay * 2, 1.0)
                continue
            except CoordError as exc:
                self._queue.put(exc)
                return
            with self._lock:
                self._stream, self._end = stream, end
            if self._closed.is_set():
                end.set()
                stream.cancel()
                return
            try:
                if not self._handle(first):
                    return
                self._ready.set()
                delay = 0.05
                for resp in stream:
                    if not self._handle(resp):
                        return
                # The server ended the stream cleanly (member shutting down): reconnect.
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                try:
                    cause = self._client.report_stream_failure(conn, exc)
                except CoordError as fatal:
                    self._queue.put(fatal)
                    return
                log.warning("watch %s: stream broke (%s); resuming at revision %d",
                            self.prefix, cause, self._next_revision)
            finally:
                end.set()
                stream.cancel()
            self.reconnects += 1
            self._closed.wait(0.05)

    def _handle(self, resp: etcdrpc.WatchResponse) -> bool:
        """Deliver one response; False when the watch must end."""
        if resp.compact_revision:
            self._queue.put(CompactedError(int(resp.compact_revision), self.prefix))
            return False
        if resp.canceled:
            reason = resp.cancel_reason or "canceled by etcd"
            self._queue.put(CoordError(f"watch {self.prefix}: {reason}"))
            return False
        if resp.created and self._next_revision == 0:
            self._next_revision = int(resp.header.revision) + 1
        batch = [_event(ev) for ev in resp.events if ev.kv.mod_revision >= self._next_revision]
        if batch:
            self._queue.put(batch)
            self._next_revision = batch[-1].mod_revision + 1
        elif not resp.events and not resp.created:
            # Progress notification: nothing under the prefix up to this revision.
            self._next_revision = max(self._next_revision, int(resp.header.revision) + 1)
        return True


def _event(ev: object) -> WatchEvent:
    kv = ev.kv  # type: ignore[attr-defined]
    kind = EventType.DELETE if ev.type == 1 else EventType.PUT  # type: ignore[attr-defined]
    return WatchEvent(
        type=kind,
        key=kv.key.decode(),
        value=bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=int(kv.create_revision),
        version=int(kv.version),
        lease=int(kv.lease),
    )


def wait_for(watch: Watch, predicate: object, timeout: float) -> WatchEvent | None:
    """Read events until one satisfies ``predicate`` or ``timeout`` passes; the others are dropped."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        for ev in watch.get(timeout=left):
            if predicate(ev):  # type: ignore[operator]
                return ev
    return None
