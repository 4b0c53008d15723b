"""``torchrun --rdzv-backend stalwart``: torch's dynamic rendezvous, with its state and store in etcd v3.

Three pieces, registered under torch's ``torchrun.handlers`` entry-point group:

- :class:`EtcdRendezvousBackend` — torch's two-method ``RendezvousBackend``: the rendezvous state
  is one etcd key and the fencing token is that key's mod revision, so ``set_state`` is a
  compare-and-swap (create-if-absent when there is no token). The stored value is framed (magic,
  length, checksum), so a damaged or foreign value raises ``RendezvousStateError`` as torch's
  contract requires, instead of reaching torch's unpickler.
- :class:`EtcdStore` — a ``torch.distributed.Store`` on etcd keys, used by torch's elastic agent
  for the per-round bootstrap (master address, rank assignment, exit barrier).
- :class:`StalwartRendezvousHandler` — wraps torch's ``DynamicRendezvousHandler`` and changes two
  things. (1) Every round gets a fresh master address and port, and the workers host their own
  TCPStore: torch's default shares one TCPStore across rounds, whose gloo keys are not prefixed
  per attempt, so a restarted rank can read a dead peer's address, and when the node hosting it
  dies the survivors keep pointing at it. (2) Health gating: a node whose stalwart agent reports
  it fatal, or that an operator cordoned, does not join.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)

from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.errors import CoordError
from stalwart.coord.keys import JobKeys
from stalwart.coord.txn import Get, Put, absent, mod_revision_is, value_is
from stalwart.coord.watch import EventType, Watch
from stalwart.proto import records_pb2

log = logging.getLogger(__name__)

# Defaults that differ from torch's: a dead node is dropped after keep_alive_interval ×
# keep_alive_max_attempt seconds (torch: 5 × 3 = 15 s), and a round waits 2 s for latecomers
# once min_nodes are there (torch: 30 s).
DEFAULTS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2}
_STORE_TIMEOUT = timedelta(seconds=300)

STATE_MAGIC = b"STWRDZV1"
_FRAME = struct.Struct("<8sQ16s")  # magic, payload length, blake2b-128 of the payload


def frame_state(state: bytes) -> bytes:
    """The stored form of a rendezvous state: magic, length and checksum, then the state."""
    return _FRAME.pack(STATE_MAGIC, len(state), hashlib.blake2b(state, digest_size=16).digest()) + state


def unframe_state(value: bytes, key: str) -> bytes:
    """The state inside a stored value; ``RendezvousStateError`` if it is not intact."""
    if len(value) < _FRAME.size:
        raise RendezvousStateError(f"stalwart rendezvous: the state at {key} is truncated or not ours")
    magic, length, digest = _FRAME.unpack_from(value)
    state = value[_FRAME.size :]
    if magic != STATE_MAGIC:
        raise RendezvousStateError(f"stalwart rendezvous: the state at {key} is not a stalwart state")
    if length != len(state) or hashlib.blake2b(state, digest_size=16).digest() != digest:
        raise RendezvousStateError(f"stalwart rendezvous: the state at {key} is corrupt (length or checksum)")
    return state


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key; the fencing token is its mod revision."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self._client = client
        self._key = keys.torchrun_state

    @property
    def name(self) -> str:
        return "stalwart"

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its token, ``None`` if there is none; ``RendezvousStateError`` if it is
        corrupt."""
        with _etcd_errors():
            kv = self._client.get(self._key)
        return None if kv is None else (unframe_state(kv.value, self._key), kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if ``token`` is still current (no token: only if no state exists).

        Returns the state now stored, its token, and whether this call wrote it; ``None`` only
        when there is no state at all (it was deleted between our write and the re-read).
        """
        if token is not None and not isinstance(token, int):
            try:
                token = int(token)
            except (TypeError, ValueError):
                token = -1  # a token not of ours can never be current
        guard = absent(self._key) if not token else mod_revision_is(self._key, token)
        stored = frame_state(state)
        with _etcd_errors():
            res = self._client.txn([guard], [Put(self._key, stored)], [Get(self._key)])
        if res.succeeded:
            return state, res.revision, True  # our write's mod revision is the txn's revision
        current = res.gets[0] if res.gets else ()
        if not current:
            return None
        if res.attempts > 1 and current[0].value == stored:
            return state, current[0].mod_revision, True  # an earlier try of this call was applied
        return unframe_state(current[0].value, self._key), current[0].mod_revision, False


class EtcdStore(Store):
    """A ``torch.distributed.Store`` on etcd keys under ``prefix``.

    Blocking reads (``get``/``wait``) watch the prefix until the keys exist or the store's
    timeout passes, then raise ``DistStoreError`` as torch's stores do.
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta = _STORE_TIMEOUT) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set(self, key: str, value: Any) -> None:
        with _etcd_errors():
            self._client.put(self._key(key), self._bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        with _etcd_errors():
            kv = self._client.get(self._key(key))
        if kv is None:
            raise dist.DistStoreError(f"stalwart store: key {key!r} was deleted while waiting for it")
        return kv.value

    def add(self, key: str, num: int) -> int:
        full = self._key(key)
        with _etcd_errors():
            while True:
                kv = self._client.get(full)
                new = (_counter(kv.value) if kv is not None else 0) + num
                # The value alone is not unique to this writer, so compare revisions, not values.
                guard = absent(full) if kv is None else mod_revision_is(full, kv.mod_revision)
                if self._client.txn([guard], [Put(full, str(new).encode())]).succeeded:
                    return new

    def append(self, key: str, value: Any) -> None:
        """Append to the key's value (creating it), atomically. torch's generic fallback is a
        compare_set loop that stops early when the old value equals the appended bytes."""
        full, tail = self._key(key), self._bytes(value)
        with _etcd_errors():
            while True:
                kv = self._client.get(full)
                guard = absent(full) if kv is None else mod_revision_is(full, kv.mod_revision)
                new = (kv.value if kv is not None else b"") + tail
                if self._client.txn([guard], [Put(full, new)]).succeeded:
                    return

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        """torch's semantics: swap when the value equals ``expected`` — an empty ``expected`` also
        matches a missing key — and return the value now stored; a missing key with another
        ``expected`` returns ``expected``. etcd cannot compare a missing key's value, so an empty
        ``expected`` is tried as "absent", then as "present and empty" at that revision."""
        full = self._key(key)
        expected, desired = self._bytes(expected_value), self._bytes(desired_value)
        with _etcd_errors():
            if expected != b"":
                res = self._client.txn([value_is(full, expected)], [Put(full, desired)], [Get(full)])
                if res.succeeded:
                    return desired
                current = res.gets[0] if res.gets else ()
                return current[0].value if current else expected
            guard = absent(full)
            while True:
                res = self._client.txn([guard], [Put(full, desired)], [Get(full)])
                if res.succeeded:
                    return desired
                current = res.gets[0] if res.gets else ()
                if not current:
                    guard = absent(full)  # deleted meanwhile
                elif current[0].value == b"":
                    guard = mod_revision_is(full, current[0].mod_revision)
                else:
                    return current[0].value

    def check(self, keys: list[str]) -> bool:
        with _etcd_errors():
            return all(self._client.get(self._key(k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        with _etcd_errors():
            return bool(self._client.delete(self._key(key)))

    def num_keys(self) -> int:
        with _etcd_errors():
            return len(self._client.get_prefix(self._prefix)[0])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        missing = {self._key(k) for k in keys}
        with _etcd_errors():
            kvs, revision = self._client.get_prefix(self._prefix)
            missing -= {kv.key for kv in kvs}
            if not missing:
                return
            with Watch(self._client, self._prefix, revision + 1) as watch:
                while missing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise dist.DistStoreError(
                            f"stalwart store: timed out after {limit:g} s waiting for {sorted(missing)}")
                    events = watch.get(timeout=min(left, 1.0))
                    missing -= {e.key for e in events if e.type is EventType.PUT}


_LEADING_INT = re.compile(rb"\s*[+-]?\d+")


def _counter(value: bytes) -> int:
    """A counter's value as torch's stores read it (C++ ``stoll``): empty is 0, a leading integer
    counts and the rest is ignored; anything else raises ``ValueError``."""
    if not value:
        return 0
    match = _LEADING_INT.match(value)
    if match is None:
        raise ValueError(f"stalwart store: {value[:40]!r} is not a counter")
    return int(match.group())


@contextmanager
def _etcd_errors() -> Iterator[None]:
    """torch's elastic agent acts on RendezvousConnectionError; give it that for any etcd failure."""
    try:
        yield
    except CoordError as exc:
        raise RendezvousConnectionError(f"stalwart rendezvous: {exc}") from exc


class StalwartRendezvousHandler(RendezvousHandler):
    """torch's dynamic rendezvous with a fresh bootstrap store per round and health gating."""

    def __init__(self, inner: DynamicRendezvousHandler, client: EtcdClient, keys: JobKeys, node_id: str,
                 health_gate: bool = True) -> None:
        self._inner = inner
        self._client = client
        self._keys = keys
        self.node_id = node_id
        self.health_gate = health_gate

    def get_backend(self) -> str:
        return "stalwart"

    @property
    def use_agent_store(self) -> bool:
        # Workers host their own TCPStore at the round's fresh master port (see module docstring).
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        self._check_health()
        previous = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # read by torch's handler in this call only
        try:
            info = self._inner.next_rendezvous()
        finally:
            if previous is None:
                os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
            else:
                os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = previous
        boot = info.bootstrap_store_info
        master = f"{boot.master_addr}:{boot.master_port}" if boot is not None else "unknown"
        log.info("stalwart rendezvous: node %s joined as rank %d of %d (master %s)", self.node_id, info.rank,
                 info.world_size, master)
        return info

    def _check_health(self) -> None:
        """Refuse to join when this node's agent says it is fatal or an operator cordoned it."""
        if not self.health_gate:
            return
        with _etcd_errors():
            health = self._client.get(self._keys.health(self.node_id))
            node = self._client.get(self._keys.node(self.node_id))
            hold = self._client.get(self._keys.cordon(self.node_id))
            faults = self._client.get(self._keys.faults(self.node_id))
        if hold is not None:
            record = _parse(records_pb2.CordonRecord, hold.value, self._keys.cordon(self.node_id))
            why = f": {record.reason}" if record.reason else ""
            msg = f"node {self.node_id} is held by an operator{why}; it does not join (uncordon it to rejoin)"
            log.error("stalwart rendezvous: %s", msg)
            raise RendezvousError(msg)
        quarantined = faults is not None and _parse(
            records_pb2.FaultRecord, faults.value, self._keys.faults(self.node_id)).quarantined
        if quarantined:
            msg = f"node {self.node_id} is quarantined after repeated faults; it does not join (uncordon it to rejoin)"
            log.error("stalwart rendezvous: %s", msg)
            raise RendezvousError(msg)
        if node is not None:
            record = _parse(records_pb2.NodeRecord, node.value, self._keys.node(self.node_id))
            if record.cordoned:
                msg = f"node {self.node_id} is cordoned by an operator; it does not join (uncordon it to rejoin)"
                log.error("stalwart rendezvous: %s", msg)
                raise RendezvousError(msg)
        if health is not None:
            verdict = _parse(records_pb2.HealthRecord, health.value, self._keys.health(self.node_id))
            if verdict.state == records_pb2.HEALTH_FATAL:
                findings = ", ".join(f"{f.code} on device {f.device}" for f in verdict.findings) or "no detail"
                msg = f"node {self.node_id} is unhealthy according to its stalwart agent ({findings}); it does not join"
                log.error("stalwart rendezvous: %s", msg)
                raise RendezvousError(msg)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        try:
            return self._inner.shutdown()
        finally:
            self._client.close()


def _parse(cls: Any, raw: bytes, key: str) -> Any:
    try:
        return cls.FromString(raw)
    except Exception as exc:  # protobuf raises DecodeError; any failure means the same here
        raise RendezvousStateError(f"stalwart rendezvous: value at {key} is not a {cls.__name__}") from exc


def etcd_config_from_params(params: RendezvousParameters) -> EtcdConfig:
    """``--rdzv-endpoint HOST:PORT[,HOST:PORT…]`` and the etcd options of ``--rdzv-conf``."""
    endpoints = tuple(e.strip() for e in (params.endpoint or "").split(",") if e.strip())
    if not endpoints:
        raise ValueError("stalwart rendezvous: --rdzv-endpoint must list at least one etcd HOST:PORT")
    timeout = float(params.get("etcd_timeout", 5.0))
    return EtcdConfig(
        endpoints=endpoints,
        timeout=timeout,
        attempt_timeout=min(timeout, float(params.get("etcd_attempt_timeout", 2.0))),
        ca_file=params.get("ca_file") or params.get("cacert"),
        cert_file=params.get("cert_file") or params.get("cert"),
        key_file=params.get("key_file") or params.get("key"),
        user=params.get("user"),
        password=params.get("password"),
    )


def create_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler torchrun asks for with ``--rdzv-backend stalwart``.

    Fails at once with ``RendezvousConnectionError`` naming the endpoints when etcd does not
    answer, rather than when the first round is attempted.
    """
    for key, value in DEFAULTS.items():
        if params.get(key) is None:
            params.config[key] = value
    config = etcd_config_from_params(params)
    keys = JobKeys(params.run_id)
    client = EtcdClient(config)
    try:
        client.status()
    except CoordError as exc:
        client.close()
        raise RendezvousConnectionError(f"stalwart rendezvous: cannot reach etcd: {exc}") from exc
    store = EtcdStore(client, keys.torchrun_store_prefix)
    backend = EtcdRendezvousBackend(client, keys)
    inner = create_handler(store, backend, params)
    node_id = str(params.get("node_id") or socket.gethostname())
    gate = str(params.get("health_gate", "1")).lower() not in ("0", "false", "no", "off")
    log.info("stalwart rendezvous: job %s, node %s, etcd %s", params.run_id, node_id, ",".join(config.endpoints))
    return StalwartRendezvousHandler(inner, client, keys, node_id, health_gate=gate)


