"""Transaction building blocks, independent of the etcd client library.

A transaction is ``if all(compares) then success_ops else failure_ops``, applied atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Target(Enum):
    VERSION = "version"
    CREATE_REVISION = "create_revision"
    MOD_REVISION = "mod_revision"
    VALUE = "value"
    LEASE = "lease"


class Cmp(Enum):
    EQUAL = "=="
    NOT_EQUAL = "!="
    LESS = "<"
    GREATER = ">"


@dataclass(frozen=True)
class Compare:
    key: str
    target: Target
    cmp: Cmp
    value: int | bytes


def absent(key: str) -> Compare:
    """True when the key does not exist (its create revision is 0)."""
    return Compare(key, Target.CREATE_REVISION, Cmp.EQUAL, 0)


def mod_revision_is(key: str, revision: int) -> Compare:
    """The fencing token: true when nobody wrote the key since ``revision`` was read."""
    return Compare(key, Target.MOD_REVISION, Cmp.EQUAL, revision)


def create_revision_is(key: str, revision: int) -> Compare:
    return Compare(key, Target.CREATE_REVISION, Cmp.EQUAL, revision)


def lease_is(key: str, lease_id: int) -> Compare:
    return Compare(key, Target.LEASE, Cmp.EQUAL, lease_id)


def value_is(key: str, value: bytes) -> Compare:
    return Compare(key, Target.VALUE, Cmp.EQUAL, value)


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


Op = Put | Delete | Get
