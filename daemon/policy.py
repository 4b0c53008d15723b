"""The rules a rendezvous daemon follows when it forms rounds, as one validated, frozen config.

Build it once at the entry point (``RoundPolicy(...)`` or ``RoundPolicy.from_mapping(table)`` for a
TOML table); the state machine only reads it. Every field has a default, every check runs in the
constructor, and every error is a :class:`PolicyError` that names the field and echoes its value.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from stalwart.coord.settings import STRICT, build
from stalwart.daemon.errors import PolicyError

__all__ = ["PolicyError", "RoundPolicy"]


@dataclass(frozen=True)
class RoundPolicy:
    """When the daemon opens, shrinks and regrows rounds. Times are in seconds.

    Fields and defaults:

    - ``min_nodes`` (1): fewest nodes a round may have; below it the daemon waits.
    - ``max_nodes`` (10000): most nodes a round may have. Set it to the job's size: the first round
      then starts as soon as that many nodes are there instead of waiting ``join_timeout``.
    - ``node_quantum`` (1): every world size is a multiple of it (e.g. the pipeline-parallel
      degree times the nodes per replica). At least one multiple must lie in
      ``[min_nodes, max_nodes]``.
    - ``world_sizes`` (empty: any): the node counts a round may have, for a job that trains only at
      some, e.g. ``[1, 2, 4, 8, 16, 32]``.
    - ``global_batch``, ``micro_batch``, ``workers_per_node`` (0: unset; all three or none): the
      job's batch sizes and workers per node. A round then has only node counts ``n`` the trainer
      can split the global batch over (``n * workers_per_node`` divides ``global_batch /
      micro_batch``; the trainer refuses any other world with ``InvalidWorldSize``): for 1024, 4
      and 8 that is 1, 2, 4, 8, 16 and 32 nodes. Every rule above applies too; at least one node
      count must satisfy them all.
    - ``join_timeout`` (60): the first round opens this long after the first node registered, or
      earlier once the largest feasible world (``max_nodes`` rounded down to the quantum) is there.
      If fewer than ``min_nodes`` are there by then, it opens as soon as they are.
    - ``regrow_cooldown`` (300): a regrow opens no sooner than this after the previous round
      opened, so that nodes that come and go cannot keep the job restarting. Shrinks never wait.
    - ``regrow_without_commit`` (60): a regrow waits for the next checkpoint commit (so that it
      redoes no step), but no longer than this after the round opened or last committed: a full
      disk, or saves far apart, must not keep the world small (the re-formed world restores the
      newest memory generation where the trainer keeps them, else the last commit).
    - ``quarantine_faults`` (3) within ``quarantine_window`` (3600): a node that faults this many
      times within the window is quarantined until an operator uncordons it.
    - ``stall_timeout`` (120): a member whose training progress does not advance for this long
      (counted from the round's opening) is stalled. Must exceed the agents' progress report
      interval and the time to restore and take the first step.
    - ``master_port`` (29500, torchrun's default): the port of the rank-0 node's rendezvous store.
    - ``straggler_factor`` (1.5), ``straggler_steps`` (5): a member whose busy time per step
      (outside collectives) exceeds the median of the other members' by this factor for this many
      consecutive progress reports is a straggler (daemon/stragglers.py); it is reported in the
      status record, ``stalwart status`` and the metrics.
    - ``exclude_stragglers`` (false): also take a straggler out of the world once the next
      checkpoint after its detection commits (a drain hold with the reason, lifted by uncordon),
      so the next round forms without it. Never when that would leave too few nodes.
    - ``shrink_to_replace`` (true): a member whose worker died with no warm spare ready (its agent
      says it is replacing) leaves the world at once if enough nodes remain, so the others re-form
      in place in well under a second instead of waiting seconds for a new process; it rejoins by
      the regrow rule once its replacement is warm. False: the round restarts with it.
    - ``agent_restart_grace`` (15): a training member whose lease is lost while its host still
      answers (its agent's port refuses: the agent crashed or restarts, its workers may train on)
      is kept in the world this long for its next agent to come back and adopt the workers; a
      report by its peers that their collectives broke on it ends the wait at once. 0: a lost
      lease shrinks the world at once, as for a lost host.
    """

    __pydantic_config__ = STRICT

    min_nodes: int = 1
    max_nodes: int = 10_000
    node_quantum: int = 1
    world_sizes: tuple[int, ...] = ()
    global_batch: int = 0
    micro_batch: int = 0
    workers_per_node: int = 0
    join_timeout: float = 60.0
    regrow_cooldown: float = 300.0
    regrow_without_commit: float = 60.0
    quarantine_faults: int = 3
    quarantine_window: float = 3600.0
    stall_timeout: float = 120.0
    master_port: int = 29500
    straggler_factor: float = 1.5
    straggler_steps: int = 5
    exclude_stragglers: bool = False
    shrink_to_replace: bool = True
    agent_restart_grace: float = 15.0

    def __post_init__(self) -> None:
        for name in ("exclude_stragglers", "shrink_to_replace"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"{name} must be true or false, got {getattr(self, name)!r}")
        value = self.straggler_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 1:
            raise PolicyError(f"straggler_factor must be a finite number > 1, got {value!r}")
        object.__setattr__(self, "straggler_factor", float(value))
        for name in ("min_nodes", "max_nodes", "node_quantum", "quarantine_faults", "master_port", "straggler_steps",
                     "global_batch", "micro_batch", "workers_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolicyError(f"{name} must be an integer, got {value!r}")
        for name in ("join_timeout", "regrow_cooldown", "regrow_without_commit", "quarantine_window", "stall_timeout",
                     "agent_restart_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PolicyError(f"{name} must be a finite number of seconds, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.min_nodes < 1:
            raise PolicyError(f"min_nodes must be at least 1, got {self.min_nodes}")
        if self.min_nodes > self.max_nodes:
            raise PolicyError(f"min_nodes ({self.min_nodes}) must not exceed max_nodes ({self.max_nodes})")
        if self.node_quantum < 1:
            raise PolicyError(f"node_quantum must be at least 1, got {self.node_quantum}")
        self._check_world_sizes()
        if self.join_timeout < 0:
            raise PolicyError(f"join_timeout must not be negative, got {self.join_timeout}")
        if self.regrow_cooldown < 0:
            raise PolicyError(f"regrow_cooldown must not be negative, got {self.regrow_cooldown}")
        if self.regrow_without_commit < 0:
            raise PolicyError(f"regrow_without_commit must not be negative, got {self.regrow_without_commit}")
        if self.quarantine_faults < 1:
            raise PolicyError(f"quarantine_faults must be at least 1, got {self.quarantine_faults}")
        if self.quarantine_window <= 0:
            raise PolicyError(f"quarantine_window must be positive, got {self.quarantine_window}")
        if self.agent_restart_grace < 0:
            raise PolicyError(f"agent_restart_grace must not be negative, got {self.agent_restart_grace}")
        if self.stall_timeout <= 0:
            raise PolicyError(f"stall_timeout must be positive, got {self.stall_timeout}")
        if self.straggler_steps < 1:
            raise PolicyError(f"straggler_steps must be at least 1, got {self.straggler_steps}")
        if not 0 < self.master_port < 65536:
            raise PolicyError(f"master_port must be in 1..65535, got {self.master_port}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object]) -> RoundPolicy:
        """Build a policy from a config table (e.g. a parsed TOML section).

        Missing keys take their defaults. Raises :class:`PolicyError` on an unknown key (a typo must
        not silently fall back to a default), a value of the wrong type, or an invalid combination.
        """
        policy: RoundPolicy = build(cls, mapping, "policy", PolicyError)
        return policy

    def _check_world_sizes(self) -> None:
        sizes = self.world_sizes
        if isinstance(sizes, list):
            sizes = tuple(sizes)
            object.__setattr__(self, "world_sizes", sizes)
        if not isinstance(sizes, tuple) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise PolicyError(f"world_sizes must be a list of node counts >= 1, got {sizes!r}")
        batch = (self.global_batch, self.micro_batch, self.workers_per_node)
        if any(batch) and not all(v > 0 for v in batch):
            raise PolicyError(f"global_batch, micro_batch and workers_per_node go together (each > 0), got "
                              f"{self.global_batch}, {self.micro_batch} and {self.workers_per_node}")
        if any(batch) and self.global_batch % self.micro_batch:
            raise PolicyError(f"global_batch ({self.global_batch}) must be a multiple of micro_batch "
                              f"({self.micro_batch})")
        per_step = self.global_batch // self.micro_batch if any(batch) else 0
        allowed = tuple(n for n in range(self.min_nodes, self.max_nodes + 1)
                        if n % self.node_quantum == 0 and (not sizes or n in sizes)
                        and (not per_step or per_step % (n * self.workers_per_node) == 0))  # fmt: skip
        if not allowed:
            rules = [f"is a multiple of node_quantum ({self.node_quantum})"]
            if sizes:
                rules.append(f"is in world_sizes {list(sizes)}")
            if per_step:
                rules.append(f"splits global_batch {self.global_batch} into micro batches of {self.micro_batch} "
                             f"over {self.workers_per_node} workers a node")
            raise PolicyError(f"no node count between min_nodes ({self.min_nodes}) and max_nodes ({self.max_nodes}) "
                              + " and ".join(rules))
        object.__setattr__(self, "_allowed", allowed)

    @property
    def allowed_world_sizes(self) -> tuple[int, ...]:
        """Every node count a round may have, ascending (never empty)."""
        allowed: tuple[int, ...] = self.__dict__["_allowed"]
        return allowed

    @property
    def largest_world_size(self) -> int:
        """The largest node count a round may have (at most ``max_nodes``)."""
        return self.allowed_world_sizes[-1]

    @property
    def smallest_world_size(self) -> int:
        """The smallest node count a round may have (at least ``min_nodes``)."""
        return self.allowed_world_sizes[0]

    def world_size_for(self, available: int) -> int | None:
        """The world size a round gets when ``available`` eligible nodes are there: the largest
        allowed node count not above it; None when even the smallest needs more."""
        allowed = self.allowed_world_sizes
        i = bisect.bisect_right(allowed, available)
        return allowed[i - 1] if i else None
