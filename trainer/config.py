"""The trainer's configuration and the records it hands back.

:class:`TrainerConfig` is what a training script passes in (validated on construction);
:class:`RestoreInfo` says which checkpoint a world started from and :class:`ReformTimings` where
the time of one in-place re-form went. Plain data, kept apart from the trainer so that reading or
building them needs neither DeepSpeed nor a world.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from stalwart.trainer.batching import DataPosition
from stalwart.trainer.health import HealthConfig
from stalwart.trainer.peer import PeerConfig


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer needs beyond DeepSpeed's config. Validated on construction.

    ``save_every_steps`` / ``save_every_seconds``: checkpoint when either is due (``None``: never
    for that rule); the time rule follows rank 0's clock. ``total_steps``: ``batches()`` ends there
    (``None``: never). ``record_path``: rank 0 appends the step record there (see ``record.py``).
    ``health``: the training-health checks and rollback policy (:class:`HealthConfig`).

    ``collective_timeout_s`` is the process groups' timeout (gloo's, and torch's default for groups
    made later, such as DeepSpeed's): how long a collective waits for a peer. A dead peer is seen
    at once (its connection closes); a hung one (deadlock, SIGSTOP, its connection still open)
    only when this runs out. So with :meth:`Trainer.train`, a survivor of a hung peer is out within
    ``collective_timeout_s`` + the re-form time (joining, engine rebuild, restore: about a second
    on a small model), once the agent's Reform has arrived. ``reform_wait_s``: after a collective
    error, how long a survivor waits for that Reform before it raises :class:`ReformFailed`.
    ``dist_timeout_s``: how long joining a world waits for its peers (store and rendezvous).
    ``abort_stuck_after_s``: when a Reform finds this rank still in a step that has run this long,
    its main thread is taken to be stuck in a collective on a lost peer (one behind a cut link or
    hung: its connections stay open, so nothing fails before ``collective_timeout_s``), and the
    old world is aborted so that the collective raises and the rank re-forms at once: NCCL aborts
    every process group (``ncclCommAbort``), gloo, which has no abort, shuts down the old world's
    connections. ``None``: 3 × the last step time, at least 0.5 s (a rank that is not stuck applies
    the Reform at the next step boundary, well within that). A rank still stuck as long again
    after the abort exits with ``EXIT_STUCK`` for a spare to take its rank (gloo cannot interrupt
    a send partly written to a peer that stopped reading).
    ``restore_read_bytes_per_s``: a budget for each restore's reads from storage, per rank
    (``None``: none), so that a whole world restoring at once does not saturate a shared file system.
    ``peer``: buddy replicas of each rank's checkpoint part in other nodes' host memory, the
    first source of a restore (:mod:`~stalwart.trainer.peer`; ``PeerConfig(replicas=0)``: off).
    ``final_save_retry_s``: how long :meth:`Trainer.finish` keeps trying again a last save that
    did not commit (a full disk, a write error: each failure is reported to the agent), every
    ``FINAL_SAVE_RETRY_EVERY_S``; the steps since the previous commit exist nowhere else once
    the job's processes end. 0: raise at once.
    """

    checkpoint_dir: str
    global_batch: int
    micro_batch: int
    dataset_len: int
    total_steps: int | None = None
    seed: int = 0
    shuffle: bool = True
    save_every_steps: int | None = 100
    save_every_seconds: float | None = None
    keep_last: int = 3
    record_path: str | None = None
    exit_on_sigterm: bool = True
    dist_timeout_s: float = 600.0
    commit_timeout_s: float = 600.0
    collective_timeout_s: float = 30.0
    reform_wait_s: float = 60.0
    abort_stuck_after_s: float | None = None
    health: HealthConfig = field(default_factory=HealthConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    restore_read_bytes_per_s: float | None = None
    final_save_retry_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ValueError("checkpoint_dir must be set")
        if self.micro_batch < 1 or self.global_batch < self.micro_batch or self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be a positive multiple of micro_batch ({self.micro_batch})"
            )
        if self.dataset_len < self.global_batch:
            raise ValueError(f"dataset_len ({self.dataset_len}) must hold one global batch ({self.global_batch})")
        if self.total_steps is not None and self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {self.total_steps}")
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1 or None, got {self.save_every_steps}")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ValueError(f"save_every_seconds must be positive or None, got {self.save_every_seconds}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if min(self.dist_timeout_s, self.commit_timeout_s, self.collective_timeout_s, self.reform_wait_s) <= 0:
            raise ValueError("dist_timeout_s, commit_timeout_s, collective_timeout_s and reform_wait_s "
                             "must be positive")
        if self.final_save_retry_s < 0:
            raise ValueError(f"final_save_retry_s must be >= 0, got {self.final_save_retry_s}")
        if self.abort_stuck_after_s is not None and self.abort_stuck_after_s <= 0:
            raise ValueError(f"abort_stuck_after_s must be positive or None, got {self.abort_stuck_after_s}")
        if not isinstance(self.health, HealthConfig):
            raise ValueError(f"health must be a HealthConfig, got {type(self.health).__name__}")
        if self.restore_read_bytes_per_s is not None and self.restore_read_bytes_per_s <= 0:
            raise ValueError(f"restore_read_bytes_per_s must be positive or None, got {self.restore_read_bytes_per_s}")
        if not isinstance(self.peer, PeerConfig):
            raise ValueError(f"peer must be a PeerConfig, got {type(self.peer).__name__}")


@dataclass(frozen=True)
class RestoreInfo:
    """Where this run started: checkpoint ``step`` (0 and ``saved_world_size`` 0 for a fresh start),
    or a memory generation of ``step`` (``from_memory``: that step is on no storage)."""

    step: int
    position: DataPosition
    saved_world_size: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    from_memory: bool = False


def process_started_at() -> float:
    """When this process started (``time.time()`` scale), from ``/proc``; now where that cannot
    be read (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass
class StartupTimings:
    """Where a process's time from its start to its first step went (``time.time()`` stamps):
    ``process_started_at`` (from the kernel), ``initialize_at`` (``Trainer.initialize`` entered:
    before it, the interpreter, the imports and the script's own set-up), ``world_at`` (the
    process group formed: waiting for the other ranks is in it), ``engine_at``
    (``deepspeed.initialize`` done), ``restored_at`` (the checkpoint loaded) and ``first_step_at``."""

    process_started_at: float
    initialize_at: float
    world_at: float = 0.0
    engine_at: float = 0.0
    restored_at: float = 0.0
    first_step_at: float | None = None

    def phases(self) -> dict[str, float]:
        """Seconds in each phase, named after what ends it."""
        marks = [("imports", self.process_started_at, self.initialize_at), ("world", self.initialize_at, self.world_at),
                 ("engine", self.world_at, self.engine_at), ("restore", self.engine_at, self.restored_at),
                 ("first step", self.restored_at, self.first_step_at or self.restored_at)]
        return {name: max(0.0, end - start) for name, start, end in marks}

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ReformTimings:
    """Where the time of one in-place re-form went; wall-clock ``time.time()`` stamps, so a
    harness can subtract them from the moment it killed a peer. ``first_step_at`` is set when the
    first step after the re-form is done."""

    round: int
    world_size: int
    rank: int
    cause: str
    error_seen_at: float | None
    started_at: float
    left_at: float = 0.0  # the old world's groups, engine and in-flight save dropped
    group_up_at: float = 0.0
    engine_built_at: float = 0.0
    restored_at: float = 0.0
    first_step_at: float | None = None
    restored_step: int = 0
    left_step: int = 0  # the last step this rank finished in the old world
    host_bytes: int = 0  # state restored from this process's host copy of the last committed save
    peer_bytes: int = 0  # from the copies of other ranks' parts held here or pulled from peers
    disk_bytes: int = 0  # read from the checkpoint files (what no live process held)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)
