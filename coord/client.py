"""A synchronous etcd v3 client with fail-over, retries to a deadline, TLS and auth.

It speaks etcd's gRPC API through the generated stubs of the ``etcd-sdk-python`` package
(``pyetcd.etcdrpc``) and owns everything above them: which member to use, when to move to
the next one, re-authenticating per member (etcd's simple tokens are member-local), and a
deadline on every call. Thread-safe: share one client per process.

Retry rules. A call is retried on another member when the one in use is unreachable, has no
leader, or timed out the request. Reads, puts and deletes are idempotent and always retried.
A transaction is retried too; because the first try may have been applied before the
connection broke, :meth:`EtcdClient.create` and :meth:`EtcdClient.compare_and_swap` re-read
the key after a retried miss and report success when the stored value is their own (values
written by stalwart name their writer, so "equal" means "mine").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from pyetcd import etcdrpc

from stalwart.coord.config import Endpoint, EtcdConfig
from stalwart.coord.errors import (
    CompactedError,
    CoordError,
    EtcdAuthError,
    EtcdQuotaExceeded,
    EtcdTimeout,
    EtcdTLSError,
    EtcdUnavailable,
    LeaseLost,
)
from stalwart.coord.txn import Cmp, Compare, Delete, Get, Op, Put, Target, absent, mod_revision_is

log = logging.getLogger(__name__)
T = TypeVar("T")

_CHANNEL_OPTIONS = [
    # Reconnect quickly to a member that comes back (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead connection (no RST) on long-lived watch streams. etcd refuses
    # pings more often than every 5 s (--grpc-keepalive-min-time).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.enable_retries", 0),
]
_TARGETS = {
    Target.VERSION: (etcdrpc.Compare.VERSION, "version"),
    Target.CREATE_REVISION: (etcdrpc.Compare.CREATE, "create_revision"),
    Target.MOD_REVISION: (etcdrpc.Compare.MOD, "mod_revision"),
    Target.VALUE: (etcdrpc.Compare.VALUE, "value"),
    Target.LEASE: (etcdrpc.Compare.LEASE, "lease"),
}
_RESULTS = {
    Cmp.EQUAL: etcdrpc.Compare.EQUAL,
    Cmp.NOT_EQUAL: etcdrpc.Compare.NOT_EQUAL,
    Cmp.LESS: etcdrpc.Compare.LESS,
    Cmp.GREATER: etcdrpc.Compare.GREATER,
}
# etcd server errors (status details) that mean "try again, maybe elsewhere": nothing was applied.
_TRANSIENT_DETAILS = ("no leader", "leader changed", "request timed out", "too many requests", "not capable")
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate")
_TXN_OPS = 100  # etcd refuses transactions of more than 128 operations by default


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    gets: tuple[tuple[KeyValue, ...], ...] = ()  # one tuple per Get op of the branch taken
    attempts: int = 1  # > 1: an earlier try may have been applied before its answer was lost


def _kv(raw: object) -> KeyValue:
    return KeyValue(
        key=raw.key.decode(),  # type: ignore[attr-defined]
        value=bytes(raw.value),  # type: ignore[attr-defined]
        create_revision=raw.create_revision,  # type: ignore[attr-defined]
        mod_revision=raw.mod_revision,  # type: ignore[attr-defined]
        version=raw.version,  # type: ignore[attr-defined]
        lease=raw.lease,  # type: ignore[attr-defined]
    )


def prefix_end(prefix: str) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


class _Conn:
    """One member: its channel, stubs and auth token."""

    def __init__(self, endpoint: Endpoint, creds: grpc.ChannelCredentials | None) -> None:
        self.endpoint = endpoint
        if creds is None:
            self.channel = grpc.insecure_channel(endpoint.netloc, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(endpoint.netloc, creds, options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.cluster = etcdrpc.ClusterStub(self.channel)
        self.token: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("token", self.token),) if self.token else None


class _Retry(Exception):
    """Internal: the attempt failed in a way that another try may fix."""

    def __init__(self, cause: str, fail_over: bool) -> None:
        super().__init__(cause)
        self.cause = cause
        self.fail_over = fail_over


class EtcdClient:
    """etcd v3 client over several endpoints. See the module docstring for the retry rules.

    Every method raises :class:`EtcdUnavailable` (or :class:`EtcdTimeout`/:class:`EtcdTLSError`)
    when no member answers within ``config.timeout``, :class:`EtcdAuthError` on bad credentials,
    and :class:`CoordError` for any other refusal by etcd.
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        creds = _credentials(config) if config.tls else None
        self._conns = [_Conn(ep, creds) for ep in config.parsed_endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

    # -- session ---------------------------------------------------------------------------

    @property
    def current_endpoint(self) -> str:
        """The member that calls go to now (changes on fail-over)."""
        with self._lock:
            return self._conns[self._current].endpoint.netloc

    def _pick(self) -> _Conn:
        with self._lock:
            return self._conns[self._current]

    def _fail_over(self, conn: _Conn, why: str) -> None:
        with self._lock:
            if self._conns[self._current] is conn and len(self._conns) > 1:
                self._current = (self._current + 1) % len(self._conns)
                log.warning(
                    "etcd %s failed (%s); switching to %s", conn.endpoint, why, self._conns[self._current].endpoint
                )

    def _authenticate(self, conn: _Conn, timeout: float) -> None:
        if self.config.user is None or conn.token is not None:
            return
        req = etcdrpc.AuthenticateRequest(name=self.config.user, password=self.config.password)
        try:
            conn.token = conn.auth.Authenticate(req, timeout=timeout).token
        except grpc.RpcError as exc:
            details = (exc.details() or "").lower()  # type: ignore[attr-defined]
            if "authentication is not enabled" in details:
                conn.token = ""  # auth off on this cluster: send no token
                return
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):  # type: ignore[attr-defined]
                raise EtcdAuthError(
                    f"etcd {conn.endpoint}: authentication as {self.config.user!r} failed: {exc.details()}"  # type: ignore[attr-defined]
                ) from exc
            raise

    def _classify(self, conn: _Conn, what: str, exc: grpc.RpcError, idempotent: bool) -> Exception:
        """Translate a gRPC error: return an exception to raise, or a ``_Retry``."""
        code = exc.code()  # type: ignore[attr-defined]
        details = exc.details() or ""  # type: ignore[attr-defined]
        low = details.lower()
        where = f"etcd {conn.endpoint}"
        if code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in low:
            conn.token = None
            return _Retry(f"{where}: auth token expired", fail_over=False)
        if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in low:
            return EtcdAuthError(f"{where}: {what}: permission denied for user {self.config.user!r}")
        if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in low:
            return EtcdAuthError(f"{where}: authentication as {self.config.user!r} failed: {details}")
        if "user name is empty" in low:
            return EtcdAuthError(f"{where}: {what}: etcd requires authentication; configure user and password")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space exceeded" in low:
            return EtcdQuotaExceeded(
                f"{where}: {what} refused: the etcd database is full (NOSPACE alarm: {details}); "
                "compact, defragment each member and disarm the alarm (etcdctl alarm disarm), "
                "or raise --quota-backend-bytes; see docs/etcd-operations.md")
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in low:
            return CompactedError(0, what)
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in low:
            return LeaseLost(f"{where}: {what}: lease not found (expired or revoked)")
        if code == grpc.StatusCode.UNAVAILABLE:
            if any(w in low for w in _TRANSIENT_DETAILS):
                return _Retry(f"{where}: {details}", fail_over=True)
            cause = "TLS handshake failed: " + details if any(w in low for w in _TLS_WORDS) else details
            return _Retry(f"{where}: unreachable: {cause}", fail_over=True)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Retry(f"{where}: no answer within the attempt timeout", fail_over=True)
        if any(w in low for w in _TRANSIENT_DETAILS):
            return _Retry(f"{where}: {details}", fail_over=True)
        return CoordError(f"{where}: {what} refused: {code.name}: {details}")

    def call(
        self, what: str, fn: Callable[[_Conn, float], T], *, idempotent: bool = True, timeout: float | None = None
    ) -> T:
        """Run ``fn(conn, attempt_timeout)`` on a member, failing over and retrying until the deadline."""
        if self._closed:
            raise CoordError("etcd client is closed")
        total = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + total
        causes: dict[str, str] = {}
        failures_in_row = 0
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._give_up(what, total, causes)
            conn = self._pick()
            attempt = min(remaining, self.config.attempt_timeout)
            try:
                self._authenticate(conn, attempt)
                return fn(conn, attempt)
            except grpc.RpcError as exc:
                outcome = self._classify(conn, what, exc, idempotent)
                if not isinstance(outcome, _Retry):
                    raise outcome from exc
                causes[conn.endpoint.netloc] = outcome.cause
                if outcome.fail_over:
                    self._fail_over(conn, outcome.cause)
                failures_in_row += 1
                if failures_in_row >= len(self._conns):
                    # Every member failed once in a row: back off before the next cycle.
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, 0.5)
                    failures_in_row = 0

    def _give_up(self, what: str, total: float, causes: dict[str, str]) -> EtcdUnavailable:
        listed = "; ".join(causes.values()) or "no attempt finished"
        msg = f"etcd {what}: no endpoint of {list(self.config.endpoints)} answered within {total:g} s: {listed}"
        if causes and all("TLS handshake failed" in c for c in causes.values()):
            return EtcdTLSError(msg)
        if causes and all("attempt timeout" in c for c in causes.values()):
            return EtcdTimeout(msg)
        return EtcdUnavailable(msg)

    def close(self) -> None:
        self._closed = True
        for conn in self._conns:
            conn.channel.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- key/value ----------------------------------------------------------------------------

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self.call(
            f"get {key}", lambda c, t: c.kv.Range(req, timeout=t, metadata=c.metadata), timeout=timeout
        )
        return _kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, *, timeout: float | None = None) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` in key order, and the store revision they were read at."""
        req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        resp = self.call(
            f"get {prefix}*", lambda c, t: c.kv.Range(req, timeout=t, metadata=c.metadata), timeout=timeout
        )
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        """Write ``value``; returns the revision of the write."""
        req = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = self.call(f"put {key}", lambda c, t: c.kv.Put(req, timeout=t, metadata=c.metadata), timeout=timeout)
        return int(resp.header.revision)

    def delete(self, key: str, *, prefix: bool = False, timeout: float | None = None) -> int:
        """Delete a key (or every key under a prefix); returns how many were deleted."""
        req = etcdrpc.DeleteRangeRequest(key=key.encode(), range_end=prefix_end(key) if prefix else b"")
        resp = self.call(
            f"delete {key}", lambda c, t: c.kv.DeleteRange(req, timeout=t, metadata=c.metadata), timeout=timeout
        )
        return int(resp.deleted)

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        """Apply ``success`` if every compare holds, else ``failure``, atomically."""
        req = etcdrpc.TxnRequest(
            compare=[_compare(c) for c in compares],
            success=[_op(o) for o in success],
            failure=[_op(o) for o in failure],
        )
        what = "txn on " + ", ".join(sorted({c.key for c in compares})) if compares else "txn"
        attempts = 0

        def send(c: _Conn, t: float) -> etcdrpc.TxnResponse:
            nonlocal attempts
            attempts += 1
            return c.kv.Txn(req, timeout=t, metadata=c.metadata)

        resp = self.call(what, send, timeout=timeout)
        gets = tuple(
            tuple(_kv(kv) for kv in r.response_range.kvs)
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        )
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), gets, attempts)

    def create(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> bool:
        """Write ``value`` only if ``key`` does not exist. True when this call created it."""
        res = self.txn([absent(key)], [Put(key, value, lease)], [Get(key)], timeout=timeout)
        return res.succeeded or _own_write(res, value, lease)

    def compare_and_swap(
        self, key: str, value: bytes, expected_mod_revision: int, *, lease: int = 0, timeout: float | None = None
    ) -> bool:
        """Write ``value`` only if the key's mod revision is still ``expected_mod_revision``
        (0: only if absent). True when this call wrote it."""
        guard = absent(key) if expected_mod_revision == 0 else mod_revision_is(key, expected_mod_revision)
        res = self.txn([guard], [Put(key, value, lease)], [Get(key)], timeout=timeout)
        return res.succeeded or _own_write(res, value, lease, after=expected_mod_revision)

    # -- leases -------------------------------------------------------------------------------

    def grant(self, ttl: int, *, timeout: float | None = None) -> int:
        """Grant a lease of ``ttl`` seconds (etcd enforces a minimum of about 2 s); returns its id."""
        if ttl < 1:
            raise ValueError(f"lease ttl must be >= 1 s, got {ttl}")
        req = etcdrpc.LeaseGrantRequest(TTL=ttl)
        resp = self.call(
            "lease grant", lambda c, t: c.lease.LeaseGrant(req, timeout=t, metadata=c.metadata), timeout=timeout
        )
        if resp.error:
            raise CoordError(f"etcd lease grant refused: {resp.error}")
        return int(resp.ID)

    def revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke a lease, deleting its keys. Revoking a lease that is already gone is not an error."""
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self.call(
                f"lease revoke {lease_id:x}",
                lambda c, t: c.lease.LeaseRevoke(req, timeout=t, metadata=c.metadata),
                timeout=timeout,
            )
        except LeaseLost:
            pass

    def keepalive_once(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Refresh a lease; returns its new TTL. Raises :class:`LeaseLost` if it has expired."""

        def refresh(c: _Conn, t: float) -> int:
            stream = c.lease.LeaseKeepAlive(iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=t,
                                            metadata=c.metadata)
            for resp in stream:
                return int(resp.TTL)
            return 0

        ttl = self.call(f"lease keepalive {lease_id:x}", refresh, timeout=timeout)
        if ttl <= 0:
            raise LeaseLost(f"etcd lease {lease_id:x} has expired or was revoked")
        return ttl

    def time_to_live(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Remaining TTL of a lease in seconds, or -1 when it no longer exists."""
        req = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        resp = self.call(
            f"lease ttl {lease_id:x}",
            lambda c, t: c.lease.LeaseTimeToLive(req, timeout=t, metadata=c.metadata),
            timeout=timeout,
        )
        return int(resp.TTL)

    # -- cluster ------------------------------------------------------------------------------

    def status(self, *, timeout: float | None = None) -> dict[str, object]:
        """The answering member's version, leader id and store revision (a cheap liveness check)."""
        req = etcdrpc.StatusRequest()
        resp = self.call("status", lambda c, t: c.maintenance.Status(req, timeout=t, metadata=c.metadata),
                         timeout=timeout)
        return {
            "version": resp.version,
            "leader": resp.leader,
            "member": resp.header.member_id,
            "revision": resp.header.revision,
            "raft_term": resp.raftTerm,
        }

    def compact(self, revision: int, *, physical: bool = True, timeout: float | None = None) -> None:
        """Drop the history before ``revision`` (keys' current values stay). ``physical``: wait
        until the space is free (slow on a large database); else etcd frees it in the background.
        Compacting at or below the revision already compacted is not an error."""
        req = etcdrpc.CompactionRequest(revision=revision, physical=physical)
        try:
            self.call("compact", lambda c, t: c.kv.Compact(req, timeout=t, metadata=c.metadata), timeout=timeout)
        except CompactedError:
            pass

    def db_size(self, *, timeout: float | None = None) -> int:
        """Bytes of the answering member's database file (what the space quota counts; it
        shrinks only when the member is defragmented)."""
        req = etcdrpc.StatusRequest()
        resp = self.call("status", lambda c, t: c.maintenance.Status(req, timeout=t, metadata=c.metadata),
                         timeout=timeout)
        return int(resp.dbSize)

    def alarms(self, *, timeout: float | None = None) -> list[tuple[int, str]]:
        """The cluster's raised alarms as (member id, "NOSPACE" or "CORRUPT")."""
        req = etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.GET, alarm=etcdrpc.NONE)
        resp = self.call("alarm list", lambda c, t: c.maintenance.Alarm(req, timeout=t, metadata=c.metadata),
                         timeout=timeout)
        return [(int(a.memberID), etcdrpc.AlarmType.Name(a.alarm)) for a in resp.alarms]

    def disarm_nospace(self, *, timeout: float | None = None) -> None:
        """Clear the NOSPACE alarm of every member (after compacting and defragmenting)."""
        for member, kind in self.alarms(timeout=timeout):
            if kind != "NOSPACE":
                continue
            req = etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.DEACTIVATE, memberID=member, alarm=etcdrpc.NOSPACE)
            self.call("alarm disarm", lambda c, t, r=req: c.maintenance.Alarm(r, timeout=t, metadata=c.metadata),
                      timeout=timeout)

    def defragment(self, *, timeout: float | None = None) -> None:
        """Defragment the member in use: rewrites its database file without the free pages that
        compaction left. The member answers nothing else meanwhile: one member at a time."""
        req = etcdrpc.DefragmentRequest()
        self.call("defragment", lambda c, t: c.maintenance.Defragment(req, timeout=t, metadata=c.metadata),
                  timeout=timeout)

    def put_many(self, items: Sequence[tuple[str, bytes, int]], *, timeout: float | None = None) -> int:
        """Write many ``(key, value, lease)`` at once, one transaction per ``_TXN_OPS`` of them
        (etcd refuses more than 128 operations in one): for many simulated nodes in one process.
        Returns the revision of the last transaction."""
        revision = 0
        for i in range(0, len(items), _TXN_OPS):
            part = items[i:i + _TXN_OPS]
            revision = self.txn([], [Put(k, v, lease) for k, v, lease in part], timeout=timeout).revision
        return revision

    def keepalive_many(self, lease_ids: Sequence[int], *, timeout: float | None = None) -> dict[int, int]:
        """Refresh many leases over one keep-alive stream; returns each lease's new TTL (0: gone)."""
        if not lease_ids:
            return {}

        def refresh(c: _Conn, t: float) -> dict[int, int]:
            requests = iter([etcdrpc.LeaseKeepAliveRequest(ID=i) for i in lease_ids])
            stream = c.lease.LeaseKeepAlive(requests, timeout=t, metadata=c.metadata)
            out: dict[int, int] = {}
            for resp in stream:
                out[int(resp.ID)] = int(resp.TTL)
                if len(out) >= len(set(lease_ids)):
                    stream.cancel()
                    break
            return out

        return self.call(f"lease keepalive x{len(lease_ids)}", refresh, timeout=timeout)

    # -- streams (used by watch.py) ---------------------------------------------------------------

    def open_watch(
        self, request: etcdrpc.WatchRequest, *, timeout: float | None = None
    ) -> tuple[grpc.Call, etcdrpc.WatchResponse, _Conn, threading.Event]:
        """Open a watch stream on a member and wait for etcd's "created" answer.

        Returns the stream, that first answer, the member, and an event that ends the stream's
        request side: set it (and cancel the stream) when done with the stream.
        """

        def open_stream(c: _Conn, t: float) -> tuple[grpc.Call, etcdrpc.WatchResponse, _Conn, threading.Event]:
            end = threading.Event()

            def requests() -> Iterator[etcdrpc.WatchRequest]:
                yield request
                end.wait()

            stream = c.watch.Watch(requests(), metadata=c.metadata)
            try:
                first = _next_with_timeout(stream, t)
            except BaseException:
                end.set()
                stream.cancel()
                raise
            return stream, first, c, end

        return self.call("watch", open_stream, timeout=timeout)

    def report_stream_failure(self, conn: _Conn, exc: grpc.RpcError) -> str:
        """Classify an error on an open stream; fails over when the member is gone. Returns the cause."""
        outcome = self._classify(conn, "watch", exc, idempotent=True)
        if isinstance(outcome, _Retry):
            if outcome.fail_over:
                self._fail_over(conn, outcome.cause)
            return outcome.cause
        raise outcome from exc


def _next_with_timeout(stream: grpc.Call, timeout: float) -> etcdrpc.WatchResponse:
    box: list[object] = []
    done = threading.Event()

    def take() -> None:
        try:
            box.append(next(stream))  # type: ignore[call-overload]
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box.append(exc)
        done.set()

    threading.Thread(target=take, daemon=True, name="etcd-watch-open").start()
    if not done.wait(timeout):
        stream.cancel()
        done.wait(1.0)
        raise _DeadlineError()
    item = box[0]
    if isinstance(item, BaseException):
        raise item
    return item  # type: ignore[return-value]


class _DeadlineError(grpc.RpcError):
    """Stands in for DEADLINE_EXCEEDED when a stream's first answer does not come in time."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "no answer to the watch request"


def _own_write(res: TxnResult, value: bytes, lease: int, after: int = 0) -> bool:
    """After a retried transaction missed: is the stored value the one this call wrote?"""
    if res.attempts < 2 or not res.gets or not res.gets[0]:
        return False
    kv = res.gets[0][0]
    return kv.value == value and kv.lease == lease and kv.mod_revision > after


def _compare(c: Compare) -> etcdrpc.Compare:
    target, field_name = _TARGETS[c.target]
    msg = etcdrpc.Compare(result=_RESULTS[c.cmp], target=target, key=c.key.encode())
    setattr(msg, field_name, c.value)
    return msg


def _op(o: Op) -> etcdrpc.RequestOp:
    if isinstance(o, Put):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=o.key.encode(), value=o.value, lease=o.lease))
    if isinstance(o, Delete):
        end = prefix_end(o.key) if o.prefix else b""
        return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=o.key.encode(), range_end=end))
    if isinstance(o, Get):
        end = prefix_end(o.key) if o.prefix else b""
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=o.key.encode(), range_end=end))
    raise TypeError(f"not a transaction op: {o!r}")


def _credentials(config: EtcdConfig) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(config.ca_file), read(config.key_file), read(config.cert_file))
