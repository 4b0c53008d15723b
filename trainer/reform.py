"""In-place re-form: the world a surviving (or spare) worker joins without restarting.

The agent learns a new round from the daemon and tells each of its workers, over the local
progress channel, which rank of which world it now holds (``AgentCommand.reform``). A worker
that stays keeps its imported torch/DeepSpeed, its model and its host copy of the last committed
checkpoint, so re-forming costs a process-group set-up and an engine rebuild instead of a restart.

This module imports nothing heavy: the agent side builds :class:`ReformSpec` values from its
protobuf messages without paying for torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

ENV_SPARE = "STALWART_SPARE"
"""``1``: the worker is a warm spare; it has no rank until the agent assigns one."""


@dataclasses.dataclass(frozen=True)
class ReformSpec:
    """One worker's place in a new round.

    ``round`` is the round number: it names the rendezvous keys of this world, so a store
    reused across rounds never hands out a previous round's keys. ``restore_step`` is the
    committed checkpoint the round restores (``None``: the newest committed one).
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    round: int
    local_rank: int = 0
    restore_step: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master port {self.master_port} is not a TCP port")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ReformSpec:
        """The torchrun environment of this process as a spec (round from ``STALWART_ROUND``)."""
        env = dict(os.environ) if env is None else env
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env["MASTER_PORT"]),
                   round=int(env.get("STALWART_ROUND", "0")), local_rank=int(env.get("LOCAL_RANK", "0")))

    @classmethod
    def from_proto(cls, reform: Any, *, local_rank: int = 0) -> ReformSpec:
        """From an ``agent_pb2.Reform`` message (``round`` is its ``RoundRecord``)."""
        rnd = reform.round
        return cls(rank=int(reform.rank), world_size=int(reform.world_size), master_addr=rnd.master_addr,
                   master_port=int(rnd.master_port), round=int(rnd.number), local_rank=local_rank,
                   restore_step=int(rnd.restore_step) if rnd.has_restore_step else None)

    def env(self) -> dict[str, str]:
        """The torchrun variables of this world (what DeepSpeed and user code read)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "STALWART_ROUND": str(self.round)}


def is_spare(env: dict[str, str] | None = None) -> bool:
    """Whether this process was started as a warm spare (``STALWART_SPARE=1``)."""
    return (os.environ if env is None else env).get(ENV_SPARE, "0") == "1"
