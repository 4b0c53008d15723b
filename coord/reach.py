"""Whether a node's agent, and the host under it, still answer: one TCP connection attempt.

The daemon and the agents ask it of the same addresses (the agents' gRPC ports, as the round
record lists them) and read the three answers alike: *accepted* (the agent is up), *refused* (the
host answers but nothing listens: the agent is gone, the host and its link are up) and *none*
(no answer within the timeout, or the network is unreachable: the host or its link is down).
"""

from __future__ import annotations

import socket
from typing import Literal

__all__ = ["Answer", "tcp_probe"]

Answer = Literal["accepted", "refused", "none"]


def tcp_probe(address: str, timeout: float) -> Answer:
    """Try one TCP connection to ``host:port`` (IPv6 hosts in brackets)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return "none"
