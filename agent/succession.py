"""Succession between agents on a node (a crash, a restart): adopting what the agent before left,
and saving what the next one needs.

At start, :meth:`SuccessionMixin._adopt` takes over, from the state file (``adopt.py``), the live
workers of the round they train in, the warm spares and the lease; the main loop rewrites the file
after every change of the workers (:meth:`SuccessionMixin._save_state`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.agent.adopt import (
    AdoptedProcess,
    AgentState,
    SpareEntry,
    StateFileError,
    WorkerEntry,
    alive_and_same,
    load_state,
    process_start_time,
    save_state,
)
from stalwart.agent.config import AgentConfig
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.preload import Preloader
from stalwart.agent.service import WorkerChannels
from stalwart.agent.spares import SparePool
from stalwart.agent.stall import StallDetector
from stalwart.agent.state import NodeState
from stalwart.agent.workers import ExitKind, RoundAssignment, Worker, WorkerExit, WorkerGroup
from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError, LeaseLost
from stalwart.coord.lease import Lease
from stalwart.proto import records_pb2

log = logging.getLogger(__name__)


class SuccessionMixin:
    """Mixed into :class:`~stalwart.agent.node.NodeAgent`: adoption and its state file."""

    # What it uses of NodeAgent (agent/node.py): attributes set in its __init__ ...
    config: AgentConfig
    client: EtcdClient
    stalls: StallDetector
    metrics: AgentMetrics
    spare_pool: SparePool
    preloader: Preloader | None
    channels: WorkerChannels
    _state: NodeState
    _lock: threading.RLock
    _lease: Lease | None
    _step_clock: dict[int, tuple[float, str]]
    _state_file: Path
    _saved_state: bytes
    _start_times: dict[int, int]
    _lost_while_away: list[WorkerExit]
    _adopted_warm: set[int]

    if TYPE_CHECKING:  # ... and the methods it calls that node.py or another part defines
        def _worker_env(self) -> dict[str, str]: ...
        def _assignment(self, record: records_pb2.RoundRecord, m: records_pb2.RoundMember) -> RoundAssignment: ...
        def _spare_exited(self, exit_: WorkerExit) -> None: ...
        def _on_lease_lost(self, why: str) -> None: ...
        def _worker_exited(self, exit_: WorkerExit) -> None: ...

    def _carry_on_lease(self) -> Lease | None:
        """Keep the lease of the agent before alive, the first thing a successor does: its node
        record and health stay under that lease, so until this agent has bound its servers,
        read the round and adopted the workers, nothing may let it expire (a successor started
        1 s after a SIGKILL, on a busy node, found its 2 s lease gone, and the daemon dropped the
        node from a round it was forming). None: no lease to carry on (no state file, or it
        expired or etcd does not answer: the agent registers anew)."""
        node = self.config.node_id
        try:
            saved = load_state(self._state_file, self.config.job, node)
        except (StateFileError, OSError):
            return None  # _adopt says why
        if saved is None or not saved.lease_id:
            return None
        try:
            lease = Lease(self.client, self.config.lease_ttl, on_lost=self._on_lease_lost, resume=saved.lease_id)
        except LeaseLost:
            log.info("agent %s: the lease of the agent before has expired; registering anew", node,
                     extra={"node": node})
            return None
        except CoordError as exc:
            log.warning("agent %s: cannot carry on the lease of the agent before (%s); registering anew", node, exc,
                        extra={"node": node})
            return None
        log.info("agent %s: carrying on lease %x of the agent before", node, lease.id, extra={"node": node})
        return lease

    def _left_live_workers(self) -> bool:
        """Whether the agent before left workers that still run: this agent starts beside
        training, so its preload process must yield to them from its first import."""
        try:
            saved = load_state(self._state_file, self.config.job, self.config.node_id)
        except (StateFileError, OSError):
            return False
        return saved is not None and any(alive_and_same(e) for e in saved.workers)

    def _adopt(self) -> None:
        """Take over what the agent before left: its live workers of the round they train in and
        its spares (its lease: :meth:`_carry_on_lease`). Workers that died while no agent watched
        are reported as failed once registered (``_lost_while_away``)."""
        node = self.config.node_id
        try:
            saved = load_state(self._state_file, self.config.job, node)
        except (StateFileError, OSError) as exc:
            log.warning("agent %s: ignoring the state file %s: %s", node, self._state_file, exc,
                        extra={"node": node})
            return
        if saved is None:
            return
        self._state.restarts = saved.restarts
        self._adopt_spares(saved)
        live = [e for e in saved.workers if alive_and_same(e)]
        record = records_pb2.RoundRecord.FromString(saved.round) if saved.round else None
        mine = [m for m in record.members if m.node_id == node] if record is not None else []
        if record is None or record.closed or not mine:
            for e in live:
                _kill_group(e.pid)
            return
        assignment = self._assignment(record, mine[0])
        group = WorkerGroup(self.config.command, assignment, self.config.log_dir, self._worker_exited,
                            extra_env=self._worker_env(), cwd=self.config.cwd, preloader=self.preloader,
                            spawn_missing=False)
        now = time.monotonic()
        with self._lock:
            for e in live:
                w = Worker(e.local_rank, e.rank, AdoptedProcess(e.pid), Path(e.log_path), round=record.number,
                           on_exit=self._worker_exited)
                w.reformed = True
                group.place(e.local_rank, w)
                self._start_times[e.pid] = e.start_time
                if e.can_reform:
                    self._state.can_reform.add(e.pid)
                self.stalls.started(w.rank, now)
                self._step_clock[w.rank] = (now, "re-form")
                w.watch()
            self._state.group, self._state.round = group, record
            adopted = {e.pid for e in live}
            self._lost_while_away = [
                WorkerExit(e.local_rank, e.rank, e.pid, -1, ExitKind.USER_ERROR,
                           "died while no agent watched it (agent restart)", time.time(), record.number)
                for e in saved.workers if e.pid not in adopted]
        self.metrics.round.labels(node).set(record.number)
        log.info("agent %s: adopted %d worker(s) of round %d from the agent before (%d died meanwhile)", node,
                 len(live), record.number, len(self._lost_while_away), extra={"node": node, "round": record.number})

    def _adopt_spares(self, saved: AgentState) -> None:
        """The warm spares the agent before left (they reconnect and say they are warm)."""
        adopted = 0
        self._adopted_warm = set()
        for e in saved.spares:
            if not alive_and_same(e):
                continue
            if e.warm:
                self._adopted_warm.add(e.pid)
            spare = Worker(-1, -1, AdoptedProcess(e.pid), Path(e.log_path), spare=True, on_exit=self._spare_exited)
            self._start_times[e.pid] = e.start_time
            self.spare_pool.add(spare)
            spare.watch()
            adopted += 1
        if saved.spares:
            log.info("agent %s: adopted %d of %d spare(s) from the agent before", self.config.node_id, adopted,
                     len(saved.spares), extra={"node": self.config.node_id})

    def _await_adopted(self, timeout: float) -> None:
        """Give adopted spares and workers a moment to reconnect before rounds are applied. A rank
        to fill would otherwise go to a cold new process while a warm spare is seconds away, and a
        round that comes while a worker is still reconnecting would find it "not connected" and
        stop it (its node would leave the world to warm a replacement for a worker that trained on
        all along). Spares only if they were warm: one still warming up connects when it can."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                group = self._state.group
                workers = [w for w in (group.workers if group is not None else []) if w.running]
            connected = self.channels.connected()
            waiting = [s.pid for s in self.spare_pool.status() if not s.ready and s.pid in self._adopted_warm]
            waiting += [w.pid for w in workers if connected.get(w.local_rank) != w.pid]
            if not waiting:
                return
            if time.monotonic() > deadline:
                log.warning("agent %s: adopted process(es) %s did not reconnect within %.1f s", self.config.node_id,
                            waiting, timeout, extra={"node": self.config.node_id})
                return
            time.sleep(0.02)

    def _save_state_safe(self) -> None:
        try:
            self._save_state()
        except OSError as exc:
            log.warning("agent %s: cannot write the state file %s: %s", self.config.node_id, self._state_file, exc,
                        extra={"node": self.config.node_id})

    def _save_state(self) -> None:
        """Write what a successor needs to adopt the workers, when it changed."""
        with self._lock:
            group, record, lease = self._state.group, self._state.round, self._lease
            if lease is None:
                return
            entries = []
            if group is not None and record is not None and not record.closed:
                for w in group.workers:
                    if not w.running or w.stopping:
                        continue
                    start = self._start_times.get(w.pid)
                    if start is None:
                        start = process_start_time(w.pid)
                        if start is None:
                            continue
                        self._start_times[w.pid] = start
                    entries.append(WorkerEntry(w.local_rank, w.rank, w.pid, start, str(w.log_path),
                                               w.pid in self._state.can_reform))
            spares = []
            warm = {s.pid for s in self.spare_pool.status() if s.warm}
            for w in self.spare_pool.workers():
                if not w.running or w.stopping:
                    continue
                start = self._start_times.get(w.pid) or process_start_time(w.pid)
                if start is not None:
                    self._start_times[w.pid] = start
                    spares.append(SpareEntry(w.pid, start, str(w.log_path), w.pid in warm))
            state = AgentState(self.config.job, self.config.node_id, lease.id,
                               record.SerializeToString() if record is not None else b"", tuple(entries),
                               self._state.restarts, tuple(spares))
        raw = state.to_json()
        if raw != self._saved_state:
            self._state_file.parent.mkdir(parents=True, exist_ok=True)
            save_state(self._state_file, state)
            self._saved_state = raw


def _kill_group(pid: int) -> None:
    """SIGKILL a left-over worker's process group (it belongs to no round this node is in)."""
    try:
        os.killpg(pid, signal.SIGKILL)
        os.killpg(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
