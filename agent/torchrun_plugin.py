"""The ``torchrun.handlers`` entry point, kept import-light.

torch's rendezvous registry loads every out-of-tree handler whenever torchrun starts, whatever
backend was asked for; the etcd client and its gRPC stack are imported only when
``--rdzv-backend stalwart`` is actually used.

Before the handler is built, ``--rdzv-conf`` is checked: a misspelt option (``join_timout=5``)
would otherwise be ignored and its default used, so an unknown key is an error that names it.
The etcd password may also come from ``password_file=PATH`` or ``$STALWART_ETCD_PASSWORD``.
"""

from __future__ import annotations

import difflib
from collections.abc import MutableMapping
from typing import Any

# The options the stalwart backend reads (docs/torchrun.md); cacert/cert/key are aliases.
OPTIONS = frozenset({
    "join_timeout", "last_call_timeout", "keep_alive_interval", "keep_alive_max_attempt", "close_timeout",
    "heartbeat_timeout", "etcd_timeout", "etcd_attempt_timeout", "ca_file", "cert_file", "key_file", "cacert",
    "cert", "key", "user", "password", "password_file", "node_id", "health_gate",
})
# What torchrun's launcher itself puts into the rendezvous config.
TORCH_OPTIONS = frozenset({"timeout", "rank"})


class RdzvConfError(ValueError):
    """An ``--rdzv-conf`` option the stalwart backend does not know, or an unreadable password file."""


def check_conf(config: MutableMapping[str, Any], environ: MutableMapping[str, str] | None = None) -> None:
    """Refuse unknown options, and resolve the password (``password_file``, then the environment)
    into ``config["password"]``. Raises :class:`RdzvConfError`."""
    import os

    from stalwart.coord.config import with_env_password
    from stalwart.coord.errors import EtcdConfigError

    for key in sorted(set(config) - OPTIONS - TORCH_OPTIONS):
        close = difflib.get_close_matches(key, sorted(OPTIONS), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(OPTIONS))}"
        raise RdzvConfError(f"stalwart rendezvous: --rdzv-conf {key}: unknown option ({hint})")
    path = config.pop("password_file", None)
    if path:
        if config.get("password"):
            raise RdzvConfError("stalwart rendezvous: --rdzv-conf: give password or password_file, not both")
        from stalwart.coord.config import read_secret

        try:
            config["password"] = read_secret(str(path))
        except EtcdConfigError as exc:
            raise RdzvConfError(f"stalwart rendezvous: {exc}") from None
    config.update(with_env_password(config, os.environ if environ is None else environ))


def torchrun_handler() -> Any:
    """torch calls this and registers the function it returns as the ``stalwart`` backend."""

    def create(params: Any) -> Any:
        from stalwart.agent.torchrun_backend import create_rendezvous_handler

        check_conf(params.config)
        return create_rendezvous_handler(params)

    return create
