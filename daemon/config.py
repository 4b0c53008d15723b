"""The daemon's whole configuration: its own settings, how to reach etcd, and the round policy.

A TOML file has three tables, each optional; every setting also has a command-line flag, and a
flag wins over the file, which wins over the default::

    [daemon]                     # DaemonSettings
    job = "llm-7b"
    [etcd]                       # stalwart.coord.EtcdConfig
    endpoints = ["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"]
    [policy]                     # RoundPolicy
    min_nodes = 8

Unknown tables and keys are errors: a typo must not fall back to a default silently. The merge
happens once, in :func:`load_config`; constructors only validate.
"""

from __future__ import annotations

import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.coord.config import EtcdConfig
from stalwart.coord.errors import EtcdConfigError
from stalwart.coord.keys import check_name
from stalwart.coord.settings import STRICT, build
from stalwart.daemon.errors import DaemonError, PolicyError
from stalwart.daemon.policy import RoundPolicy

__all__ = ["ConfigError", "DaemonConfig", "DaemonSettings", "default_daemon_id", "load_config"]

TABLES = ("daemon", "etcd", "policy")
SECRET_KEYS = frozenset({"password", "password_file"})


class ConfigError(DaemonError, ValueError):
    """The daemon's configuration is invalid: unreadable file, bad TOML, unknown table or key,
    or a bad value. The message names the setting (and the file) and echoes the value."""


def default_daemon_id() -> str:
    """Host name and process id: unique among the daemons of one job, readable in logs."""
    host = socket.gethostname().split(".")[0] or "daemon"
    return f"{host}-{os.getpid()}"


@dataclass(frozen=True)
class DaemonSettings:
    """The daemon's own settings. Times in seconds.

    - ``job`` (required): the job's name; its keys live under ``/stalwart/<job>/``.
    - ``daemon_id`` (host name and pid): names this daemon in the leader record and in rounds.
    - ``lease_ttl`` (5): TTL of the leader lease. A standby takes over this long (plus up to a
      second) after the leader dies; at least 2 (etcd's minimum).
    - ``tick_interval`` (1): the longest the loop waits before checking time-based rules
      (join timeout, stall timeout, cool-down) when no event arrives.
    - ``batch_window`` (0.05): after a watch event, collect further events this long and decide
      once, so that many nodes lost together change the world once.
    - ``status_interval`` (2): the least time between two writes of the waiting status to etcd
      (it changes with every registration while a job forms).
    - ``metrics_host`` ("0.0.0.0"), ``metrics_port`` (9464): Prometheus ``/metrics``; 0 disables.
    - ``health_host`` ("0.0.0.0"), ``health_port`` (0): the gRPC health service; 0 disables.
    - ``compact_interval`` (300): the leader compacts etcd's history this often, keeping at least
      this long of it (as etcd's ``--auto-compaction-mode=periodic`` would): a job writes for months
      and uncompacted revisions fill the database quota. 0: leave it to etcd's own setting.
    - ``keep_ckpt_records`` (100): checkpoint commit records kept in etcd, newest first; older
      ones are deleted (the checkpoints themselves are kept or removed by the checkpoint
      retention, on storage). 0: keep every record.
    - ``on_quarantine`` (none): a command (argv list) the leader runs for each node it quarantines,
      so the scheduler stops handing the node out (Slurm drain, Kubernetes cordon); ``{node}``,
      ``{job}`` and ``{reason}`` are replaced in each argument (see :mod:`stalwart.daemon.hooks`).
    - ``hook_timeout`` (30): seconds one run of that command may take before it is killed.
    """

    __pydantic_config__ = STRICT

    job: str = ""
    daemon_id: str = ""
    lease_ttl: int = 5
    tick_interval: float = 1.0
    batch_window: float = 0.05
    status_interval: float = 2.0
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464
    health_host: str = "0.0.0.0"
    health_port: int = 0
    compact_interval: float = 300.0
    keep_ckpt_records: int = 100
    on_quarantine: tuple[str, ...] = ()
    hook_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("job", "daemon_id", "metrics_host", "health_host"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"daemon.{name} must be a string, got {getattr(self, name)!r}")
        if not self.job:
            raise ConfigError("daemon.job is required (the job whose rounds this daemon decides)")
        try:
            check_name("job", self.job)
        except EtcdConfigError as exc:
            raise ConfigError(f"daemon.job: {exc}") from exc
        if not self.daemon_id:
            object.__setattr__(self, "daemon_id", default_daemon_id())
        for name in ("lease_ttl", "metrics_port", "health_port", "keep_ckpt_records"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"daemon.{name} must be an integer, got {value!r}")
        if self.lease_ttl < 2:
            raise ConfigError(f"daemon.lease_ttl must be at least 2 s (etcd's minimum), got {self.lease_ttl}")
        if not isinstance(self.on_quarantine, tuple) or not all(isinstance(a, str) for a in self.on_quarantine):
            raise ConfigError(f"daemon.on_quarantine must be a list of strings (a command), got {self.on_quarantine!r}")
        if self.on_quarantine and not self.on_quarantine[0]:
            raise ConfigError("daemon.on_quarantine: the command's first element (the program) is empty")
        for name in ("tick_interval", "batch_window", "status_interval", "compact_interval", "hook_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"daemon.{name} must be a finite number of seconds, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0 < self.tick_interval <= self.lease_ttl / 2:
            raise ConfigError(f"daemon.tick_interval must be in (0, lease_ttl/2 = {self.lease_ttl / 2:g}], "
                              f"got {self.tick_interval:g}")
        if not 0 <= self.batch_window < self.tick_interval:
            raise ConfigError(f"daemon.batch_window must be in [0, tick_interval), got {self.batch_window:g}")
        if self.compact_interval < 0:
            raise ConfigError(f"daemon.compact_interval must not be negative (0: off), got {self.compact_interval:g}")
        if self.keep_ckpt_records < 0:
            raise ConfigError(f"daemon.keep_ckpt_records must not be negative (0: keep all), "
                              f"got {self.keep_ckpt_records}")
        if self.hook_timeout <= 0:
            raise ConfigError(f"daemon.hook_timeout must be positive, got {self.hook_timeout:g}")
        if self.status_interval < 0:
            raise ConfigError(f"daemon.status_interval must not be negative, got {self.status_interval:g}")
        for name in ("metrics_port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"daemon.{name} must be in 0..65535 (0: off), got {getattr(self, name)}")


@dataclass(frozen=True)
class DaemonConfig:
    daemon: DaemonSettings
    etcd: EtcdConfig
    policy: RoundPolicy


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: not valid TOML: {exc}") from exc


def _settings(mapping: Mapping[str, Any], where: str) -> DaemonSettings:
    return build(DaemonSettings, mapping, f"{where}: daemon", ConfigError)


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Mapping[str, Any]] | None = None) -> DaemonConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides`` (from flags), per table.

    Raises :class:`ConfigError` for any problem, including the round policy's and etcd's own
    validation errors (re-raised with the file named, the original chained).
    """
    where = f"config file {str(path)!r}" if path is not None else "config"
    data: dict[str, Any] = _read_toml(path) if path is not None else {}
    unknown = sorted(set(data) - set(TABLES))
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {unknown}; known: {list(TABLES)}")
    tables: dict[str, dict[str, Any]] = {}
    for name in TABLES:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{name}] must be a table, got {table!r}")
        given = dict((overrides or {}).get(name, {}))
        if name == "etcd" and given.keys() & SECRET_KEYS:
            # password and password_file are one setting: a flag's (or the environment's) wins
            table = {k: v for k, v in table.items() if k not in SECRET_KEYS}
        tables[name] = {**table, **given}
    etcd_table = tables["etcd"]
    if isinstance(etcd_table.get("endpoints"), list):
        etcd_table["endpoints"] = tuple(etcd_table["endpoints"])
    try:
        settings = _settings(tables["daemon"], where)
        etcd = EtcdConfig.from_mapping(etcd_table)
        policy = RoundPolicy.from_mapping(tables["policy"])
    except ConfigError:
        raise
    except (PolicyError, EtcdConfigError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return DaemonConfig(settings, etcd, policy)

