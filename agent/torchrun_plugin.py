"""The ``torchrun.handlers`` entry point, kept import-light.

torch's rendezvous registry loads every out-of-tree handler whenever torchrun starts, whatever
backend was asked for; the etcd client and its gRPC stack are imported only when
``--rdzv-backend stalwart`` is actually used.
"""

from __future__ import annotations

from typing import Any


def torchrun_handler() -> Any:
    """torch calls this and registers the function it returns as the ``stalwart`` backend."""

    def create(params: Any) -> Any:
        from stalwart.agent.torchrun_backend import create_rendezvous_handler

        return create_rendezvous_handler(params)

    return create
