"""Errors of the etcd adapter. Every client exception is translated into one of these.

Callers act on the type: retry later (``EtcdUnavailable``/``EtcdTimeout``), fix the
configuration (``EtcdConfigError``, ``EtcdAuthError``, ``EtcdTLSError``), re-read state
(``CompactedError``), tell the operator (``EtcdQuotaExceeded``), step down (``NotLeader``, ``LeaseLost``).
"""

from __future__ import annotations


class CoordError(Exception):
    """Base of every error raised by ``stalwart.coord``."""


class EtcdConfigError(CoordError, ValueError):
    """The etcd settings are invalid (bad endpoint, missing or unreadable TLS file, ...)."""


class EtcdUnavailable(CoordError, ConnectionError):
    """No etcd endpoint answered before the call's deadline. The message names each endpoint and why."""


class EtcdTimeout(EtcdUnavailable, TimeoutError):
    """An endpoint was connected but the call did not finish before its deadline."""


class EtcdTLSError(EtcdUnavailable):
    """The TLS handshake with an endpoint failed (wrong CA, wrong or missing client certificate)."""


class EtcdAuthError(CoordError, PermissionError):
    """Authentication failed or the user lacks permission for the operation."""


class EtcdQuotaExceeded(CoordError):
    """etcd's database reached its space quota (``--quota-backend-bytes``, 2 GiB by default) and
    raised the NOSPACE alarm: every write is refused (reads and deletes still work) until an
    operator compacts, defragments and disarms the alarm. Nothing was written; the caller keeps
    what it meant to write and tries again later. Not retried here: waiting cannot fix it."""


class CompactedError(CoordError):
    """A watch asked for history that etcd has compacted away; re-read the state and watch again."""

    def __init__(self, compact_revision: int, key: str) -> None:
        super().__init__(
            f"watch on {key!r}: revisions before {compact_revision} were compacted; re-read and watch again"
        )
        self.compact_revision = compact_revision
        self.key = key


class LeaseLost(CoordError):
    """The lease expired or was revoked: every key bound to it is gone."""


class NotLeader(CoordError):
    """A write guarded by leadership was rejected: this process no longer leads."""
