"""Every etcd key stalwart uses, for one job. No key string is built anywhere else.

Layout (docs/design.md, "etcd layout")::

    /stalwart/<job>/nodes/<node>        node record, bound to the agent's lease
    /stalwart/<job>/health/<node>       latest health verdict from the agent
    /stalwart/<job>/progress/<node>     last step and step time (rate-limited)
    /stalwart/<job>/leader              daemon leader, bound to the leader's lease
    /stalwart/<job>/round               current round
    /stalwart/<job>/ckpt/<step>         commit record of a checkpoint
    /stalwart/<job>/cordon/<node>       operator hold (cordon, drain) or its lifting; no lease
    /stalwart/<job>/faults/<node>       the daemon's fault times and quarantine of a node; no lease
    /stalwart/<job>/status              the daemon leader's latest "why no round" (rate-limited)
    /stalwart/<job>/torchrun/state      torchrun rendezvous state (``--rdzv-backend stalwart``)
    /stalwart/<job>/torchrun/store/...  torchrun rendezvous store keys (chosen by torch)

Steps are zero-padded so that a prefix read returns checkpoints in step order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from stalwart.coord.errors import EtcdConfigError

ROOT = "/stalwart"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STEP_DIGITS = 20


class Kind(Enum):
    NODE = "nodes"
    HEALTH = "health"
    PROGRESS = "progress"
    CKPT = "ckpt"
    LEADER = "leader"
    ROUND = "round"
    TORCHRUN = "torchrun"
    CORDON = "cordon"
    FAULTS = "faults"
    STATUS = "status"


def check_name(what: str, name: str) -> str:
    """Job and node names become key segments: refuse anything that could split or escape one."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise EtcdConfigError(
            f"{what} name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class ParsedKey:
    kind: Kind
    name: str | None  # node id, or the step as text for checkpoints; None for singletons

    @property
    def step(self) -> int:
        if self.kind is not Kind.CKPT or self.name is None:
            raise ValueError(f"{self.kind.value} key has no step")
        return int(self.name)


class JobKeys:
    """Keys of one job. ``prefix`` covers all of them, so one watch sees the whole job."""

    def __init__(self, job: str) -> None:
        self.job = check_name("job", job)
        self.prefix = f"{ROOT}/{job}/"

    def _per(self, kind: Kind) -> str:
        return f"{self.prefix}{kind.value}/"

    @property
    def nodes_prefix(self) -> str:
        return self._per(Kind.NODE)

    @property
    def health_prefix(self) -> str:
        return self._per(Kind.HEALTH)

    @property
    def progress_prefix(self) -> str:
        return self._per(Kind.PROGRESS)

    @property
    def ckpt_prefix(self) -> str:
        return self._per(Kind.CKPT)

    @property
    def cordon_prefix(self) -> str:
        return self._per(Kind.CORDON)

    @property
    def faults_prefix(self) -> str:
        return self._per(Kind.FAULTS)

    def cordon(self, node: str) -> str:
        """Operator holds live apart from the node key: they must outlive the agent's lease."""
        return self.cordon_prefix + check_name("node", node)

    def faults(self, node: str) -> str:
        """Fault history and quarantine, kept by the daemon so that a standby leader inherits them."""
        return self.faults_prefix + check_name("node", node)

    @property
    def status(self) -> str:
        return self.prefix + Kind.STATUS.value

    def node(self, node: str) -> str:
        return self.nodes_prefix + check_name("node", node)

    def health(self, node: str) -> str:
        return self.health_prefix + check_name("node", node)

    def progress(self, node: str) -> str:
        return self.progress_prefix + check_name("node", node)

    def ckpt(self, step: int) -> str:
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        return f"{self.ckpt_prefix}{step:0{_STEP_DIGITS}d}"

    @property
    def leader(self) -> str:
        return self.prefix + Kind.LEADER.value

    @property
    def round(self) -> str:
        return self.prefix + Kind.ROUND.value

    @property
    def torchrun_state(self) -> str:
        return self._per(Kind.TORCHRUN) + "state"

    @property
    def torchrun_store_prefix(self) -> str:
        """Keys below it are named by torch's elastic agent, not by us."""
        return self._per(Kind.TORCHRUN) + "store/"

    def parse(self, key: str) -> ParsedKey | None:
        """Classify a key under this job's prefix; None for keys this layout does not name."""
        if not key.startswith(self.prefix):
            return None
        rest = key[len(self.prefix):]
        head, sep, name = rest.partition("/")
        try:
            kind = Kind(head)
        except ValueError:
            return None
        if kind in (Kind.LEADER, Kind.ROUND, Kind.STATUS):
            return ParsedKey(kind, None) if not sep else None
        if kind is Kind.TORCHRUN:
            return ParsedKey(kind, name) if sep and name else None
        if not sep or not name or "/" in name:
            return None
        if kind is Kind.CKPT:
            return ParsedKey(kind, name) if name.isdigit() else None
        return ParsedKey(kind, name) if _NAME.match(name) else None
