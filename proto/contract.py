"""The agent ↔ trainer contract outside the gRPC messages (``agent.proto``).

What a node agent and the training processes it starts agree on: the environment the agent
sets for its workers (besides torchrun's ``RANK``, ``WORLD_SIZE``, …), the exit status a worker
uses to give the job up, and the layout of the local progress socket. Each side imports them
from here; neither imports the other (docs/design.md, "Components and the direction of imports").
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ENV_COLLECTIVE_TIMER",
    "ENV_NODE",
    "ENV_RESTORE_STEP",
    "ENV_ROUND",
    "ENV_SOCKET",
    "ENV_ORPHAN_TIMEOUT",
    "DEFAULT_ORPHAN_TIMEOUT",
    "ENV_SPARE",
    "EXIT_DIVERGED",
    "EXIT_STUCK",
    "GAVE_UP_PREFIX",
    "SOCKET_DIR_MODE",
    "SOCKET_MODE",
    "socket_target",
]

GAVE_UP_PREFIX: Final = "the job gave up"
"""How the reason of a round that the daemon closed because the job gave up starts (the round's
record, read by agents: such a round stays closed, so its workers are stopped, not kept)."""

ENV_SOCKET: Final = "STALWART_AGENT_SOCKET"
"""Path of the agent's unix socket, the progress channel (``stalwart.v1.Progress``). Unset: the
process runs without an agent and reports nothing."""

ENV_NODE: Final = "STALWART_NODE"
"""The node id of the worker's agent: which ranks share a node (the trainer places each rank's
peer replica on another node)."""

ENV_ORPHAN_TIMEOUT: Final = "STALWART_ORPHAN_TIMEOUT"
"""Seconds a worker trains on without its agent (crashed, restarting) before it takes itself for
orphaned and stops: its agent's successor adopts it well within that."""
DEFAULT_ORPHAN_TIMEOUT: Final = 30.0

ENV_ROUND: Final = "STALWART_ROUND"
"""Number of the round the worker was started for (names the rendezvous keys of its world)."""

ENV_RESTORE_STEP: Final = "STALWART_RESTORE_STEP"
"""Committed checkpoint step the round restores; unset: the newest committed one."""

ENV_SPARE: Final = "STALWART_SPARE"
"""``1``: the process is a warm spare, started without a rank; it waits for the agent's
assignment (a ``Reform``) on the progress channel."""

ENV_COLLECTIVE_TIMER: Final = "STALWART_COLLECTIVE_TIMER"
"""Unset or ``1``: the trainer times its ``torch.distributed`` collectives to report busy time;
``0``: it does not."""

EXIT_DIVERGED: Final = 3
"""Exit status of a training script stopped by repeated training-health faults (the job gave
up; a crash is 1, a SIGTERM with its final checkpoint 0). The agent reports it as "the job gave
up" and the daemon closes the job instead of restarting it."""

EXIT_STUCK: Final = 5
"""Exit status of a worker that could not leave a world with a hung peer: a collective stuck on
it outlived the abort of the old world (gloo cannot interrupt a send partly written to a peer
that stopped reading). The agent hands its rank to a warm spare, as for a crash; it is not a
fault of the node's own."""

SOCKET_DIR_MODE: Final = 0o700
"""The socket's directory: created by the agent with this mode; a group- or world-usable one is
refused."""

SOCKET_MODE: Final = 0o600
"""The socket itself: only the agent's user may connect."""


def socket_target(path: str) -> str:
    """The gRPC target of the progress socket at ``path`` (the agent binds it, workers dial it)."""
    return f"unix:{path}"
