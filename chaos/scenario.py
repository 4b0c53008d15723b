"""Chaos scenarios as TOML files: the cluster, the training job, and a timeline of faults.

    name = "default"
    seed = 7

    [cluster]
    etcd_members = 3
    daemons = 2
    nodes = 3
    workers_per_node = 1

    [job]
    steps = 120
    checkpoint_every = 10

    [[fault]]
    kind = "kill-worker"
    at_step = 20
    node = "node1"          # optional: else chosen with the seed

    [random]                # optional: faults at random, on top of the timeline
    rate_per_minute = 2
    kinds = ["kill-worker", "hang-worker"]

Unknown keys and unknown fault kinds are errors that name them.
"""

from __future__ import annotations

import random
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

FAULT_KINDS = (
    "kill-worker",  # SIGKILL one worker process
    "hang-worker",  # SIGSTOP one worker process
    "gpu-fault",  # fake Xid (code, default 79) through the agent
    "network-cut",  # take a node's link down (its own network namespace; needs root)
    "corrupt-checkpoint",  # flip a byte in the newest committed checkpoint
    "fill-disk",  # fill the checkpoint file system (a small tmpfs; needs root)
    "kill-agent",  # SIGKILL a node's agent (its workers train on; the agent is restarted and adopts them)
    "restart-agent",  # restart a node's agent the systemd way (SIGUSR1 hand-off, then a new agent)
    "kill-node",  # SIGKILL a node's agent, workers and spares (the node is lost); it is back after `duration`
    "kill-daemon",  # SIGKILL the daemon leader
    "kill-etcd",  # SIGKILL one etcd member
    "lose-quorum",  # SIGKILL a majority of the etcd members for `duration` seconds
    "nan-loss",  # the trainer of one rank sees a NaN loss at step at_step (timed: a few steps on), via the agent
    "loss-spike",  # the same with the loss multiplied by `factor`
    "slow-worker",  # the agent throttles one worker to 1/`factor` speed for `duration` seconds
)


class ScenarioError(ValueError):
    """The scenario file is invalid; the message names the setting."""


@dataclass(frozen=True)
class ClusterSpec:
    etcd_members: int = 3
    daemons: int = 2
    nodes: int = 3
    workers_per_node: int = 1
    lease_ttl: int = 2
    min_nodes: int = 1
    node_quantum: int = 1
    checkpoint_fs_mb: int = 64  # size of the checkpoint tmpfs, when a fill-disk fault needs one
    exclude_stragglers: bool = False  # the daemons take a straggler out at the next checkpoint
    reform_in_place: bool = True  # survivors of a round change re-form in place (false: restart all)
    # each node in its own network namespace with its own address, as on separate hosts (needs root;
    # always so with a network-cut fault)
    node_network: bool = False
    spares: int = 0  # warm spare workers per node
    # modules each agent's preload process imports once; its workers and spares are forked from it
    # (AgentConfig.preload; empty: every worker starts cold). torch's compiler stack is imported
    # lazily by the optimizer and by deepspeed.initialize: 1.5 s of a worker's start without it
    preload: tuple[str, ...] = ("torch", "deepspeed", "stalwart.trainer", "torch._dynamo",
                                "torch._inductor.compile_fx", "networkx")


@dataclass(frozen=True)
class JobSpec:
    steps: int = 100
    checkpoint_every: int = 10
    zero_stage: int = 1
    global_batch: int = 12
    micro_batch: int = 1
    step_time: float = 0.0  # extra seconds per step, to make a tiny model's steps visible
    samples: int = 100_000
    script: str = "examples/train_gpt.py"
    max_rollbacks: int = 3  # training-health rollbacks allowed within 1,000 steps before the job gives up
    # examples/train_gpt.py only: buddy replicas per rank (TrainerConfig.peer), and a budget for a
    # restore's reads from storage in MB/s per rank (0: none; a slow shared file system), and a
    # memory generation (a restore point kept in peers' memory) every this many steps (0: none)
    peer_replicas: int = 1
    memory_every: int = 1
    restore_read_mbps: float = 0.0


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    at_step: int | None = None
    at_time: float | None = None
    node: str | None = None
    rank: int = 0  # local rank for worker faults, device for GPU faults
    code: int = 79  # Xid for gpu-fault
    duration: float = 5.0  # network-cut, fill-disk, slow-worker, lose-quorum, kill-node: seconds until undone
    factor: float = 0.0  # loss-spike: loss multiplier (default 1000); slow-worker: slow-down (default 2)
    # "regrow": once at_step/at_time is reached, wait for the next regrow round and inject while
    # its re-form is in flight ("": at once)
    during: str = ""


@dataclass(frozen=True)
class RandomSpec:
    rate_per_minute: float = 1.0
    kinds: tuple[str, ...] = ("kill-worker",)
    duration_s: float = 600.0


@dataclass(frozen=True)
class Scenario:
    name: str
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    job: JobSpec = field(default_factory=JobSpec)
    faults: tuple[FaultSpec, ...] = ()
    random: RandomSpec | None = None
    seed: int = 0

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.cluster.nodes)]

    def uses(self, kind: str) -> bool:
        """Whether the timeline (fixed or random) can inject ``kind``."""
        return any(f.kind == kind for f in self.faults) or (self.random is not None and kind in self.random.kinds)

    def random_faults(self) -> list[FaultSpec]:
        """The random part of the timeline, fixed by the seed so a failing run can be replayed."""
        if self.random is None:
            return []
        rng = random.Random(self.seed)
        out, t = [], 0.0
        while True:
            t += rng.expovariate(self.random.rate_per_minute / 60.0)
            if t >= self.random.duration_s:
                return out
            out.append(FaultSpec(kind=rng.choice(self.random.kinds), at_time=round(t, 3),
                                 node=rng.choice(self.node_names())))


def _build(cls: Any, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ScenarioError(f"scenario: {where}: expected a table")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ScenarioError(f"scenario: {where}.{unknown[0]}: unknown setting (known: {sorted(known)})")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ScenarioError(f"scenario: {where}: {exc}") from None


def from_mapping(data: Mapping[str, Any]) -> Scenario:
    data = dict(data)
    allowed = {"name", "seed", "cluster", "job", "fault", "random"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ScenarioError(f"scenario: {unknown[0]}: unknown setting (known: {sorted(allowed)})")
    cluster = _build(ClusterSpec, data.get("cluster", {}), "cluster")
    job = _build(JobSpec, data.get("job", {}), "job")
    faults = []
    for i, raw in enumerate(data.get("fault", [])):
        f = _build(FaultSpec, raw, f"fault[{i}]")
        if f.kind not in FAULT_KINDS:
            raise ScenarioError(f"scenario: fault[{i}].kind: unknown fault {f.kind!r} (known: {list(FAULT_KINDS)})")
        if (f.at_step is None) == (f.at_time is None):
            raise ScenarioError(f"scenario: fault[{i}]: give exactly one of at_step and at_time")
        if f.during not in ("", "regrow"):
            raise ScenarioError(f"scenario: fault[{i}].during: {f.during!r} is not \"regrow\" (or empty)")
        if f.node is not None and f.node not in [f"node{n}" for n in range(cluster.nodes)]:
            raise ScenarioError(f"scenario: fault[{i}].node: no node {f.node!r} in a cluster of {cluster.nodes}")
        faults.append(f)
    rnd = None
    if "random" in data:
        raw = dict(data["random"])
        if "kinds" in raw:
            raw["kinds"] = tuple(raw["kinds"])
        rnd = _build(RandomSpec, raw, "random")
        bad = [k for k in rnd.kinds if k not in FAULT_KINDS]
        if bad:
            raise ScenarioError(f"scenario: random.kinds: unknown fault {bad[0]!r}")
    scenario = Scenario(name=str(data.get("name", "unnamed")), cluster=cluster, job=job, faults=tuple(faults),
                        random=rnd, seed=int(data.get("seed", 0)))
    _validate(scenario)
    return scenario


def _validate(s: Scenario) -> None:
    c, j = s.cluster, s.job
    checks = [
        (c.etcd_members >= 1, "cluster.etcd_members", "must be >= 1"),
        (c.daemons >= 1, "cluster.daemons", "must be >= 1"),
        (c.nodes >= 1, "cluster.nodes", "must be >= 1"),
        (c.workers_per_node >= 1, "cluster.workers_per_node", "must be >= 1"),
        (1 <= c.min_nodes <= c.nodes, "cluster.min_nodes", f"must be within 1..{c.nodes}"),
        (c.checkpoint_fs_mb >= 8, "cluster.checkpoint_fs_mb", "must be >= 8"),
        (0 <= c.spares <= 8, "cluster.spares", "must be within 0..8"),
        (c.spares == 0 or c.reform_in_place, "cluster.spares", "spares need reform_in_place = true"),
        (j.steps >= 1, "job.steps", "must be >= 1"),
        (j.checkpoint_every >= 1, "job.checkpoint_every", "must be >= 1"),
        (j.zero_stage in (0, 1, 2, 3), "job.zero_stage", "must be 0, 1, 2 or 3"),
        (j.max_rollbacks >= 0, "job.max_rollbacks", "must be >= 0"),
        (j.memory_every >= 0, "job.memory_every", "must be >= 0 (0: no memory generations)"),
    ]
    for ok, name, why in checks:
        if not ok:
            raise ScenarioError(f"scenario: {name}: {why}")


def load(path: str | Path) -> Scenario:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ScenarioError(f"scenario {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario {path}: not valid TOML: {exc}") from None
    return from_mapping(data)
