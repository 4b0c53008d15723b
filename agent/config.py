"""The agent's configuration: one TOML file, every setting overridable by a flag, validated once.

    job = "llm-7b"
    node_id = "gpu-node-017"          # default: the host name
    command = ["python", "train.py"]  # what each worker runs
    workers = 8                       # workers on this node
    listen = "0.0.0.0:7077"           # the agent's gRPC service (TLS unless insecure = true)

    [etcd]
    endpoints = ["etcd1:2379", "etcd2:2379", "etcd3:2379"]

A bad file gives one ``AgentConfigError`` line naming the setting and the value. Types are
exact (``coord/settings.py``): the settings that guard the node — ``insecure``,
``fault_injection``, ``tls.client_auth`` — take only real booleans, because a quoted
``"false"`` would otherwise be true. Settings that weaken security are allowed, but named by
:func:`security_warnings`, which the agent logs at start.
"""

from __future__ import annotations

import os
import socket
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

from stalwart.agent.preload import parse_command
from stalwart.coord.config import EtcdConfig, with_env_password
from stalwart.coord.errors import EtcdConfigError
from stalwart.coord.keys import check_name
from stalwart.coord.settings import STRICT, build


class AgentConfigError(ValueError):
    """The agent's configuration is invalid; the message names the setting."""


def _command(value: object) -> object:
    """A command given as one string is split on white space; a TOML array becomes a tuple."""
    if isinstance(value, str):
        return tuple(value.split())
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS of the agent's gRPC service.

    ``client_auth`` (true): clients must present a certificate signed by ``ca_file``; without it
    anyone who reaches the port may call ``Drain``, so turning it off must be explicit.
    """

    __pydantic_config__ = STRICT

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    client_auth: bool = True


@dataclass(frozen=True)
class TLSCredentials:
    """The PEM contents of the TLS files, checked to load (a key that matches its certificate)."""

    cert: bytes
    key: bytes
    ca: bytes | None


@dataclass(frozen=True)
class AgentConfig:
    __pydantic_config__ = STRICT

    job: str
    command: Annotated[tuple[str, ...], BeforeValidator(_command)]
    node_id: str = field(default_factory=socket.gethostname)
    workers: int = 1
    listen: str = "127.0.0.1:0"
    advertise: str | None = None  # address others reach this agent at; default: listen's
    insecure: bool = False  # plain TCP for the gRPC service: only when explicitly asked
    tls: TLSConfig = field(default_factory=TLSConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    state_dir: str = "/var/lib/stalwart"  # worker logs and the progress socket
    # The workers' progress socket. Default: <state_dir>/run/agent.sock, in a directory the agent
    # creates with mode 0700; an existing directory must already be private (it is never chmod-ed).
    progress_socket: str | None = None
    lease_ttl: int = 5
    stop_grace: float = 10.0
    probe: str = "auto"  # nvml, fake or auto
    probe_interval: float = 1.0
    fault_injection: bool = False
    stall_floor: float = 10.0
    stall_factor: float = 5.0
    stall_first_step: float = 300.0
    stall_frozen_after: float = 0.3  # seconds a stopped (SIGSTOP) worker may stay so before it is stalled
    progress_interval: float = 5.0  # seconds between progress writes to etcd (rate limit)
    peer_probe_interval: float = 5.0
    # When a worker stalls with its process running (blocked in a collective), the agent checks
    # this many of the round's members after its own (a ring): one whose host does not answer is
    # reported lost, so a cut link costs a stall timeout, not a lease TTL. O(1) in the world size.
    peer_probe_neighbours: int = 3
    metrics_port: int | None = None
    metrics_host: str | None = None  # default: listen's host
    cwd: str | None = None
    slow_worker_period: float = 0.02  # fault injection: mean run phase of the FAULT_SLOW_WORKER stop cycle
    busy_window: int = 9  # steps in the recent median of each rank's busy time
    straggler_factor: float = 1.5  # a local rank this much busier than the node's others is a straggler
    # In-place re-form: at a new round keep live, healthy workers that can re-form (their trainer
    # set a re-form handler) and send them their new rank, instead of restarting every worker.
    reform_in_place: bool = True
    # seconds a kept worker or spare has to begin its re-form (leave its old world), else SIGKILL; more
    # than the trainer's collective timeout (30 s), which a survivor blocked on a lost peer waits out first
    reform_timeout: float = 40.0
    # Warm spares per node: processes of the same command started with STALWART_SPARE=1 that import
    # and build everything, then wait for a rank. 0 by default: a command must support spares
    # (AgentClient.wait_for_assignment), and each spare costs a process's memory.
    spares: int = 0
    # Spares warm at this nice value (0-19; 0: the workers' own) and get the workers' priority back
    # when they take a rank, so they can start with the round's workers instead of after their
    # first step. Only where the agent may raise a priority again (root, or RLIMIT_NICE >= 20).
    spare_nice: int = 10
    # A worker that dies with no ready spare makes the node "replacing": it asks the daemon to
    # leave it out (the others re-form at once) while it warms one spare per local worker; after
    # this many seconds without them it stops asking and rejoins with cold processes.
    replace_timeout: float = 300.0
    # Modules a preload process imports once, as the agent starts, so that workers and spares are
    # forked from it instead of each importing them (agent/preload.py): for example ["torch",
    # "deepspeed"]. Empty (the default): every worker is started cold. Needs a command of the form
    # `python [options] script.py ...` or `python [options] -m module ...`.
    preload: Annotated[tuple[str, ...], BeforeValidator(_command)] = ()
    preload_wait: float = 120.0  # seconds a starting agent waits for its preload process before it registers

    def __post_init__(self) -> None:
        # Also when built in code rather than from a file: a truthy non-boolean must not turn
        # off TLS or allow fault injection.
        for name, value in (("insecure", self.insecure), ("fault_injection", self.fault_injection),
                            ("tls.client_auth", self.tls.client_auth)):
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        _check(bool(self.command), "command", "must name the program each worker runs")
        if self.preload:
            _check(parse_command(self.command) is not None, "preload",
                   "needs a command of the form `python [options] script.py ...` or `python [options] -m module "
                   f"...`, got {' '.join(self.command)!r}")
            for name in self.preload:
                _check(bool(name) and all(part.isidentifier() for part in name.split(".")), "preload",
                       f"{name!r} is not a module name")
        _check(self.preload_wait >= 0, "preload_wait", f"must be >= 0, got {self.preload_wait}")
        _check(self.workers >= 1, "workers", f"must be >= 1, got {self.workers}")
        _check(self.peer_probe_neighbours >= 0, "peer_probe_neighbours",
               f"must be >= 0, got {self.peer_probe_neighbours}")
        _check(self.lease_ttl >= 2, "lease_ttl", f"must be >= 2 s (etcd's minimum), got {self.lease_ttl}")
        for name in ("stop_grace", "probe_interval", "progress_interval", "peer_probe_interval", "stall_floor",
                     "stall_first_step", "stall_frozen_after"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check(self.stall_factor >= 1, "stall_factor", f"must be >= 1, got {self.stall_factor}")
        _check(0.001 <= self.slow_worker_period <= 10, "slow_worker_period",
               f"must be within [0.001, 10] s, got {self.slow_worker_period}")
        _check(self.busy_window >= 1, "busy_window", f"must be >= 1 step, got {self.busy_window}")
        _check(self.replace_timeout > 0, "replace_timeout", f"must be > 0 s, got {self.replace_timeout}")
        _check(self.reform_timeout > 0, "reform_timeout", f"must be > 0 s, got {self.reform_timeout}")
        _check(0 <= self.spares <= 64, "spares", f"must be within [0, 64] per node, got {self.spares}")
        _check(0 <= self.spare_nice <= 19, "spare_nice", f"must be within [0, 19], got {self.spare_nice}")
        _check(self.spares == 0 or self.reform_in_place, "spares",
               "warm spares take a rank by re-forming in place: they need reform_in_place = true")
        _check(self.straggler_factor > 1, "straggler_factor", f"must be > 1, got {self.straggler_factor}")
        _check(self.probe in ("nvml", "fake", "auto"), "probe", f"must be nvml, fake or auto, got {self.probe!r}")
        _check(":" in self.listen, "listen", f"must be HOST:PORT, got {self.listen!r}")
        if self.metrics_port is not None:
            _check(0 <= self.metrics_port < 65536, "metrics_port",
                   f"must be within 0..65535 (0: any free port), got {self.metrics_port}")
        if not self.insecure:
            _check(bool(self.tls.cert_file and self.tls.key_file), "tls",
                   "the gRPC service needs tls.cert_file and tls.key_file, or insecure = true")
            _check(bool(self.tls.ca_file) or not self.tls.client_auth, "tls.ca_file",
                   "needed to authenticate clients (tls.client_auth = true, the default); set "
                   "tls.client_auth = false to let anyone who reaches the port call the service")
        for name in ("job", "node_id"):
            try:
                check_name(name, getattr(self, name))
            except EtcdConfigError as exc:
                raise AgentConfigError(f"{name}: {exc}") from None

    @property
    def socket_path(self) -> Path:
        return Path(self.progress_socket) if self.progress_socket else Path(self.state_dir) / "run" / "agent.sock"

    @property
    def log_dir(self) -> Path:
        return Path(self.state_dir) / "logs"

    @property
    def metrics_bind_host(self) -> str:
        """Where ``/metrics`` listens: ``metrics_host``, else the host of ``listen``."""
        if self.metrics_host is not None:
            return self.metrics_host
        host = self.listen.rsplit(":", 1)[0].strip("[]")
        return host or "0.0.0.0"


def security_warnings(config: AgentConfig) -> list[str]:
    """The settings that leave the node less protected than the defaults, one line each."""
    out = []
    if config.insecure:
        out.append(f"insecure = true: the gRPC service on {config.listen} is plain TCP, without TLS; anyone who "
                   "reaches it can read it and call Drain")
    elif not config.tls.client_auth:
        out.append("tls.client_auth = false: clients are not authenticated; anyone who reaches "
                   f"{config.listen} can call Drain")
    if config.fault_injection:
        out.append("fault_injection = true: InjectFault is allowed (kills and hangs workers); chaos testing only")
    return out


def tls_credentials(tls: TLSConfig) -> TLSCredentials:
    """Read and check the service's TLS files: each must be PEM, the key must match the
    certificate, and the CA must load. Raises :class:`AgentConfigError` naming the file."""
    assert tls.cert_file and tls.key_file
    cert, key = _pem(tls.cert_file, "cert_file", "CERTIFICATE"), _pem(tls.key_file, "key_file", "PRIVATE KEY")
    ca = _pem(tls.ca_file, "ca_file", "CERTIFICATE") if tls.ca_file else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as exc:
        raise AgentConfigError(f"agent config: tls.cert_file {tls.cert_file} and tls.key_file {tls.key_file}: "
                               f"cannot be loaded together ({exc.reason or exc})") from None
    if tls.ca_file:
        try:
            context.load_verify_locations(cafile=tls.ca_file)
        except ssl.SSLError as exc:
            raise AgentConfigError(f"agent config: tls.ca_file {tls.ca_file}: not a usable CA bundle "
                                   f"({exc.reason or exc})") from None
    return TLSCredentials(cert, key, ca)


def _pem(path: str, name: str, kind: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise AgentConfigError(f"agent config: tls.{name} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or kind.encode() not in data:
        raise AgentConfigError(f"agent config: tls.{name} {path}: not a PEM file with a {kind} "
                               "(expected a '-----BEGIN ...' block)")
    return data


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise AgentConfigError(f"agent config: {name}: {why}")


def from_mapping(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Build from a parsed file, strictly (exact types, no unknown keys); the etcd password may
    come from ``$STALWART_ETCD_PASSWORD`` (``environ``, default ``os.environ``)."""
    data = dict(data)
    if isinstance(data.get("etcd"), Mapping):
        data["etcd"] = with_env_password(data["etcd"], os.environ if environ is None else environ)
    try:
        return build(AgentConfig, data, "agent config", AgentConfigError)
    except EtcdConfigError as exc:
        raise AgentConfigError(f"agent config: etcd: {exc}") from None


def load(path: str | Path, overrides: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Read a TOML file, apply flag overrides (``None`` values are ignored), validate."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise AgentConfigError(f"agent config: {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"agent config: {path}: not valid TOML: {exc}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
    return from_mapping(data, environ)


def with_overrides(config: AgentConfig, **changes: Any) -> AgentConfig:
    return replace(config, **{k: v for k, v in changes.items() if v is not None})
