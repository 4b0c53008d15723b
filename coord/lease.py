"""Leases kept alive in the background, with a clear signal when one is lost.

A lease is refreshed every ``ttl / 3`` seconds. It counts as lost when etcd says so (the lease
expired or was revoked), or when no refresh has succeeded for a whole TTL: by then etcd has
expired it, or will before any write of ours could land. Once lost, a lease never comes back;
the owner must grant a new one and re-create its keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError, LeaseLost

log = logging.getLogger(__name__)


class Lease:
    """A granted lease and its keep-alive thread.

    ``on_lost`` callbacks run once, on the keep-alive thread, when the lease is lost (not when
    it is revoked through :meth:`revoke`). ``lost`` is an event callers may wait on.
    """

    def __init__(self, client: EtcdClient, ttl: int, *, on_lost: Callable[[str], None] | None = None,
                 resume: int | None = None) -> None:
        """``resume``: keep an existing lease alive instead of granting one (a restarted process
        carrying on its predecessor's registration); raises :class:`LeaseLost` if it has expired."""
        self._client = client
        self.ttl = ttl
        if resume is not None:
            client.keepalive_once(resume)
            self.id = resume
        else:
            self.id = client.grant(ttl)
        self.lost = threading.Event()
        self.lost_reason = ""
        self._callbacks: list[Callable[[str], None]] = [on_lost] if on_lost else []
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"etcd-lease {self.id:x}")
        self._thread.start()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Register a callback; called at once if the lease is already lost."""
        self._callbacks.append(callback)
        if self.lost.is_set():
            callback(self.lost_reason)

    @property
    def alive(self) -> bool:
        return not self.lost.is_set() and not self._stop.is_set()

    def _run(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        wait = interval
        while not self._stop.wait(wait):
            budget = self.ttl - (time.monotonic() - self._last_ok)
            if budget <= 0:
                self._declare_lost(f"no keep-alive succeeded for {self.ttl} s")
                return
            try:
                self._client.keepalive_once(self.id, timeout=min(budget, interval))
                self._last_ok = time.monotonic()
                wait = interval
            except LeaseLost as exc:
                self._declare_lost(str(exc))
                return
            except CoordError as exc:
                # Retry soon: an etcd leader election or fail-over usually ends within a second.
                log.warning("lease %x: keep-alive failed (%s); %.1f s of TTL left", self.id, exc, budget)
                wait = 0.1

    def _declare_lost(self, reason: str) -> None:
        if self._stop.is_set():
            return
        self.lost_reason = reason
        self.lost.set()
        log.error("lease %x lost: %s", self.id, reason)
        for callback in self._callbacks:
            try:
                callback(reason)
            except Exception:  # a broken callback must not hide the loss from the others
                log.exception("lease %x: on_lost callback failed", self.id)

    def stop(self) -> None:
        """Stop refreshing without revoking: the lease expires after its TTL (as on a crash)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.ttl + 1)

    def revoke(self) -> None:
        """Stop refreshing and revoke now, deleting every key bound to the lease."""
        self.stop()
        try:
            self._client.revoke(self.id)
        except CoordError as exc:
            log.warning("lease %x: revoke failed (%s); it expires after its TTL", self.id, exc)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revoke()
