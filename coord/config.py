"""How to reach etcd: endpoints, deadlines, TLS and auth, validated once when built.

The password can stay out of config files: ``password_file`` names a file holding it, and every
component takes it from ``$STALWART_ETCD_PASSWORD`` when a user but no password is configured
(:func:`with_env_password`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BeforeValidator

from stalwart.coord.errors import EtcdConfigError
from stalwart.coord.settings import STRICT, build

PASSWORD_ENV = "STALWART_ETCD_PASSWORD"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.netloc


def parse_endpoint(text: str) -> tuple[Endpoint, bool | None]:
    """Parse ``host:port``, ``http://host:port`` or ``https://host:port``.

    Returns the endpoint and whether its scheme asks for TLS (None when no scheme is given).
    """
    raw = text.strip()
    tls: bool | None = None
    for scheme, is_tls in (("https://", True), ("http://", False), ("unixs://", True), ("unix://", False)):
        if raw.startswith(scheme):
            raw, tls = raw[len(scheme):], is_tls
            break
    raw = raw.rstrip("/")
    if raw.startswith("["):
        host, _, rest = raw[1:].partition("]")
        port_text = rest.lstrip(":")
    else:
        host, _, port_text = raw.rpartition(":")
    if not host or not port_text:
        raise EtcdConfigError(f"etcd endpoint {text!r}: expected HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise EtcdConfigError(f"etcd endpoint {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise EtcdConfigError(f"etcd endpoint {text!r}: port {port} is out of range")
    return Endpoint(host, port), tls


def _split(value: object) -> object:
    """``"a:1,b:2"`` (a flag) or a TOML array as a tuple; anything else is left for strict validation."""
    if isinstance(value, str):
        return tuple(e for e in value.split(",") if e.strip())
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class EtcdConfig:
    """Settings for :class:`stalwart.coord.client.EtcdClient`.

    ``timeout`` bounds every call, retries and fail-over included; ``attempt_timeout`` bounds one
    try on one endpoint, so a member that hangs is left for the next one in time. ``password``
    or ``password_file`` (read once, here; a trailing newline is dropped), not both.
    """

    __pydantic_config__ = STRICT

    endpoints: Annotated[tuple[str, ...], BeforeValidator(_split)] = ("127.0.0.1:2379",)
    timeout: float = 5.0
    attempt_timeout: float = 2.0
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None

    def __post_init__(self) -> None:
        if self.password_file is not None:
            if self.password is not None:
                raise EtcdConfigError("etcd auth: give password or password_file, not both")
            object.__setattr__(self, "password", read_secret(self.password_file))
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", tuple(e for e in self.endpoints.split(",") if e.strip()))
        else:
            object.__setattr__(self, "endpoints", tuple(self.endpoints))
        if not self.endpoints:
            raise EtcdConfigError("etcd endpoints: at least one HOST:PORT is needed")
        schemes = {parse_endpoint(e)[1] for e in self.endpoints} - {None}
        if len(schemes) > 1:
            raise EtcdConfigError(f"etcd endpoints {list(self.endpoints)}: mix of http:// and https://")
        if schemes == {True} and not self.ca_file:
            raise EtcdConfigError("etcd endpoints use https:// but no ca_file is configured")
        if self.timeout <= 0:
            raise EtcdConfigError(f"etcd timeout must be > 0, got {self.timeout}")
        if self.attempt_timeout <= 0:
            raise EtcdConfigError(f"etcd attempt_timeout must be > 0, got {self.attempt_timeout}")
        if (self.cert_file is None) != (self.key_file is None):
            raise EtcdConfigError("etcd TLS: cert_file and key_file must be given together")
        if (self.user is None) != (self.password is None):
            raise EtcdConfigError("etcd auth: user and password must be given together")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None:
                _check_pem(name, path)

    @property
    def parsed_endpoints(self) -> list[Endpoint]:
        return [parse_endpoint(e)[0] for e in self.endpoints]

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EtcdConfig:
        """Build from a config-file table, strictly: unknown keys and wrong types are errors."""
        return build(cls, data, "etcd", EtcdConfigError)


def with_env_password(table: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``table`` with the password from ``$STALWART_ETCD_PASSWORD`` when it names a user but
    neither a password nor a password file, so the secret shows neither in a file nor in ``ps``."""
    out = dict(table)
    secret = (os.environ if environ is None else environ).get(PASSWORD_ENV)
    if secret and out.get("user") and out.get("password") is None and out.get("password_file") is None:
        out["password"] = secret
    return out


def read_secret(path: str) -> str:
    """A secret kept in a file (one line; the trailing newline is not part of it)."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise EtcdConfigError(f"etcd auth: password_file {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if not secret:
        raise EtcdConfigError(f"etcd auth: password_file {path!r} is empty")
    return secret


def _check_pem(name: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise EtcdConfigError(f"etcd TLS {name} {path!r}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in head:
        raise EtcdConfigError(f"etcd TLS {name} {path!r}: not a PEM file")
    if not os.path.isfile(path):
        raise EtcdConfigError(f"etcd TLS {name} {path!r}: not a regular file")
