"""Leader election on one key, and writes that only the current leader can make.

The leader is whoever created the election key, bound to its lease. The key's create revision
is the leader's term: it changes every time leadership changes hands, so a write guarded by
``create_revision == term`` (and ``lease == leader's lease``) fails for a deposed leader even
if it does not yet know it was deposed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.coord.client import EtcdClient, KeyValue, TxnResult
from stalwart.coord.errors import EtcdTimeout, LeaseLost, NotLeader
from stalwart.coord.lease import Lease
from stalwart.coord.txn import Compare, Delete, Get, Op, Put, absent, create_revision_is, lease_is
from stalwart.coord.watch import EventType, Watch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leadership:
    """Proof of leadership: the election key, the term (its create revision) and the lease."""

    key: str
    term: int
    lease_id: int
    value: bytes

    def guards(self) -> list[Compare]:
        return [create_revision_is(self.key, self.term), lease_is(self.key, self.lease_id)]


class Election:
    """Campaign for, observe and resign the leadership stored at ``key``."""

    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self.key = key

    def leader(self) -> KeyValue | None:
        """The current leader's record, or None when nobody leads."""
        return self._client.get(self.key)

    def campaign(self, lease: Lease, value: bytes, timeout: float | None = None) -> Leadership:
        """Block until this candidate leads (or ``timeout`` passes: :class:`EtcdTimeout`).

        ``value`` should name the candidate uniquely. Raises :class:`LeaseLost` if the lease is
        lost while waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if lease.lost.is_set():
                raise LeaseLost(f"election {self.key}: lease {lease.id:x} lost while campaigning")
            res = self._client.txn([absent(self.key)], [Put(self.key, value, lease.id)], [Get(self.key)])
            current = res.gets[0][0] if res.gets and res.gets[0] else None
            if res.succeeded or (current and current.value == value and current.lease == lease.id):
                term = res.revision if res.succeeded else current.create_revision  # type: ignore[union-attr]
                log.info("election %s: leading with term %d", self.key, term)
                return Leadership(self.key, term, lease.id, value)
            # Someone else leads: wait for the key to go away, then try again.
            if not self._wait_for_vacancy(res.revision + 1, deadline, lease):
                raise EtcdTimeout(f"election {self.key}: not elected within {timeout} s")

    def _wait_for_vacancy(self, from_revision: int, deadline: float | None, lease: Lease) -> bool:
        with Watch(self._client, self.key, from_revision) as watch:
            # Re-check after the watch is open: the key may have gone before it started.
            if self._client.get(self.key) is None:
                return True
            while deadline is None or time.monotonic() < deadline:
                if lease.lost.is_set():
                    return True  # the caller raises LeaseLost
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                for ev in watch.get(timeout=wait):
                    if ev.key == self.key and ev.type is EventType.DELETE:
                        return True
        return False

    def resign(self, leadership: Leadership) -> bool:
        """Give up leadership; True if this call removed the key (False: already deposed)."""
        res = self._client.txn([create_revision_is(self.key, leadership.term)], [Delete(self.key)])
        return res.succeeded

    def guarded_txn(
        self,
        leadership: Leadership,
        compares: Sequence[Compare] = (),
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """A transaction applied only while ``leadership`` holds.

        Raises :class:`NotLeader` when the leadership is gone (whatever ``compares`` say). When
        leadership holds but ``compares`` fail, returns the result with ``succeeded=False``.
        """
        first = self._client.txn([*leadership.guards(), *compares], success, [Get(self.key), *failure])
        if first.succeeded:
            return first
        if not _still_leads(first, leadership):
            raise NotLeader(f"election {self.key}: term {leadership.term} is over; write refused")
        return first

    def guarded_put(self, leadership: Leadership, key: str, value: bytes) -> int:
        """Write ``key`` only while leading; returns the write's revision or raises :class:`NotLeader`."""
        return self.guarded_txn(leadership, (), [Put(key, value)]).revision


def _still_leads(res: TxnResult, leadership: Leadership) -> bool:
    current = res.gets[0][0] if res.gets and res.gets[0] else None
    return current is not None and current.create_revision == leadership.term and current.lease == leadership.lease_id
