"""What the node agent's servers call (``service.AgentCore``): the workers' reports over the
progress socket, and the node service's status, drain and fault injection.

These run on gRPC threads, the workers' progress streams among them: a worker's reports must not
wait on etcd, so a checkpoint's commit record is written on a thread of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from stalwart.agent.config import AgentConfig
from stalwart.agent.core import lost_before_step, stale_hello
from stalwart.agent.health import FakeProbe, HealthProbe
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.service import FaultRefused, HelloEvent, StepEvent, WorkerChannels
from stalwart.agent.spares import SparePool
from stalwart.agent.stall import StallDetector
from stalwart.agent.state import NodeState, Progress
from stalwart.agent.throttle import Throttle, ThrottleSpec
from stalwart.agent.workers import ExitKind
from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError
from stalwart.coord.keys import JobKeys
from stalwart.proto import agent_pb2, records_pb2
from stalwart.proto.contract import ENV_SOCKET

log = logging.getLogger(__name__)


class AgentApiMixin:
    """Mixed into :class:`~stalwart.agent.node.NodeAgent`: the calls of its gRPC servers."""

    # What it uses of NodeAgent (agent/node.py): attributes set in its __init__ ...
    config: AgentConfig
    client: EtcdClient
    keys: JobKeys
    probe: HealthProbe
    stalls: StallDetector
    metrics: AgentMetrics
    channels: WorkerChannels
    spare_pool: SparePool
    _state: NodeState
    _lock: threading.RLock
    _commands: queue.Queue[tuple[str, object]]
    _drop_peers: threading.Event
    _throttles: dict[int, Throttle]
    _step_clock: dict[int, tuple[float, str]]
    _unrecorded: dict[int, records_pb2.CheckpointRecord]

    if TYPE_CHECKING:  # ... and the methods it calls that node.py or another part defines
        @property
        def address(self) -> str: ...
        def _spare_metrics(self) -> None: ...
        def _health_record(self) -> records_pb2.HealthRecord: ...
        def _poll_probe(self) -> None: ...
        def _publish_health(self, force: bool = False) -> None: ...
        def local_stragglers(self) -> dict[int, float]: ...

    # -- AgentCore (called from gRPC threads) -------------------------------------------------------

    def node_id(self) -> str:
        return self.config.node_id

    def dropping_peers(self) -> bool:
        return self._drop_peers.is_set()

    def round_number(self) -> int:
        with self._lock:
            return self._state.round.number if self._state.round else 0

    def round_number_nowait(self) -> int:
        """The current round without taking the agent's lock (for log context: logging must
        never wait on the agent)."""
        rnd = self._state.round
        return rnd.number if rnd is not None else 0

    def stale_worker(self, hello: HelloEvent) -> str | None:
        """Why ``hello`` is from a stale worker (``core.stale_hello``), or None."""
        if hello.spare:
            return None
        with self._lock:
            group, rnd = self._state.group, self._state.round
            holder = group.worker(hello.local_rank) if group is not None else None
            return stale_hello(hello_round=hello.round, hello_pid=hello.pid,
                               current_round=rnd.number if rnd is not None else None,
                               holder_pid=holder.pid if holder is not None else None,
                               holder_running=holder is not None and holder.running,
                               pending=hello.pid in self._state.pending)

    def fence_stale(self, pid: int, why: str) -> None:
        """Kill a stale worker (its process group), once it is known to be one of this node's:
        its environment names this agent's progress socket. Its stream is refused either way."""
        node = self.config.node_id
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            env = []
        ours = f"{ENV_SOCKET}={self.config.socket_path}".encode() in env
        log.error("agent %s: stale worker refused%s: %s", node, ", killed" if ours else "", why, extra={"node": node})
        if ours:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def worker_hello(self, hello: HelloEvent) -> None:
        node = self.config.node_id
        if hello.spare and hello.warm and self._warm_after_taken(hello.pid):
            return
        if hello.spare:
            if (self.spare_pool.warm if hello.warm else self.spare_pool.ready)(hello.pid):
                log.info("agent %s: spare (pid %d) %s", node, hello.pid, "warm" if hello.warm else "connected",
                         extra={"node": node})
                self._spare_metrics()
            else:
                log.warning("agent %s: pid %d says it is a spare but is not one of ours", node, hello.pid,
                            extra={"node": node})
            return
        if self.spare_pool.is_spare(hello.pid):
            # A spare that did not say so: the command ignores STALWART_SPARE=1 and would train as
            # a rank it was never given. Stop the spares rather than let them spin.
            doomed = self.spare_pool.disable(f"spare pid {hello.pid} said Hello as rank {hello.rank}: the command "
                                             "does not support STALWART_SPARE=1 (AgentClient.wait_for_assignment)")
            for w in doomed:
                w.kill()
            return
        log.info("agent %s: rank %d (pid %d) connected for round %d", node, hello.rank, hello.pid, hello.round,
                 extra={"node": node, "rank": hello.rank, "round": hello.round})
        now = time.monotonic()
        with self._lock:
            if hello.can_reform:
                self._state.can_reform.add(hello.pid)
            else:
                self._state.can_reform.discard(hello.pid)
            pending = self._state.pending.get(hello.pid)
            acked = pending is not None and hello.round >= pending.round and hello.rank == pending.rank
            if acked:
                assert pending is not None
                del self._state.pending[hello.pid]
                self.stalls.started(hello.rank, now)  # the first step after a re-form gets its allowance
            p = self._state.progress.setdefault(hello.rank, Progress(busy=deque(maxlen=self.config.busy_window)))
            p.local_rank = hello.local_rank
        if pending is not None and acked:
            self.metrics.reforms.labels(node, "acknowledged").inc()
            self.metrics.reform_seconds.labels(node).set(now - pending.sent)
            log.info("agent %s: rank %d (pid %d) re-formed into round %d in %.3f s", node, hello.rank, hello.pid,
                     hello.round, now - pending.sent, extra={"node": node, "rank": hello.rank, "round": hello.round})
        elif pending is not None and hello.round >= pending.round:
            log.error("agent %s: pid %d acknowledged round %d as rank %d, but was told rank %d", node, hello.pid,
                      hello.round, hello.rank, pending.rank, extra={"node": node, "round": hello.round})

    def _warm_after_taken(self, pid: int) -> bool:
        """A spare given its rank while it was still warming says it is warm: its re-form begins
        now, so its deadline starts now. False if ``pid`` is no such spare."""
        now = time.monotonic()
        with self._lock:
            pending = self._state.pending.get(pid)
            group = self._state.group
            w = group.worker(pending.local_rank) if group is not None and pending is not None else None
            if pending is None or w is None or w.pid != pid or not w.warming:
                return False
            w.warming = False
            self._state.pending[pid] = dataclasses.replace(pending, warming=False,
                                                           deadline=now + self.config.reform_timeout)
        log.info("agent %s: spare (pid %d) warm: it begins its re-form into round %d as rank %d", self.config.node_id,
                 pid, pending.round, pending.rank,
                 extra={"node": self.config.node_id, "rank": pending.rank, "round": pending.round})
        return True

    def worker_step(self, event: StepEvent) -> None:
        with self._lock:
            rnd = self._state.round
            if event.round and rnd is not None and event.round < rnd.number:
                return  # a kept worker still in its old world: its rank there is not its rank now
            now = time.monotonic()
            self.stalls.step(event.rank, event.step, event.step_time, now)
            p = self._state.progress.setdefault(event.rank, Progress(busy=deque(maxlen=self.config.busy_window)))
            p.step, p.step_time, p.at = event.step, event.step_time, event.at
            p.busy.append(event.busy_time)
            since, after = self._step_clock.get(event.rank, (now, ""))
            self._step_clock[event.rank] = (now, "")
            group = self._state.group
            # one rank per node counts, so that a node's lost time is not counted once per worker
            lost = lost_before_step(now - since, self.stalls.typical(event.rank), after) \
                if group is not None and event.rank == group.assignment.first_rank else None
        self.metrics.step(event.rank, event.step, event.step_time)
        if lost is not None:
            self.metrics.badput.labels(self.config.node_id, lost[0]).inc(lost[1])

    def worker_goodbye(self, pid: int, reason: str) -> None:
        """Kept for an adopted worker, whose exit status this agent cannot read."""
        with self._lock:
            group = self._state.group
            for w in group.workers if group is not None else []:
                if w.pid == pid:
                    w.goodbye = reason

    def worker_checkpoint(self, rank: int, step: int, path: str, committed: bool) -> None:
        if not committed:  # the trainer reports a save that failed (a full disk, say); training goes on
            log.warning("agent %s: rank %d checkpoint at step %d failed: not committed", self.config.node_id, rank,
                        step, extra={"node": self.config.node_id, "rank": rank})
            return
        log.info("agent %s: rank %d checkpoint at step %d committed", self.config.node_id, rank, step)
        with self._lock:
            if self._state.committed_step is None or step > self._state.committed_step:
                self._state.committed_step = step
        self.metrics.checkpoint_time.labels(self.config.node_id).set(time.time())
        if rank != 0:
            return  # one commit record per checkpoint, from the agent of rank 0
        with self._lock:
            rnd = self._state.round
        record = records_pb2.CheckpointRecord(step=step, path=path, world_size=rnd.world_size if rnd else 0,
                                              round=rnd.number if rnd else 0, committed_at=time.time())
        with self._lock:
            self._unrecorded[step] = record
        # Not on this (the progress stream's) thread: an etcd without quorum would hold up the
        # worker's step reports behind it, and the stall detector would take it for a hang.
        threading.Thread(target=self._record_checkpoints, daemon=True, name="agent-ckpt-record").start()

    def _record_checkpoints(self) -> None:
        """Write the commit records etcd has not taken yet (it had no quorum): the checkpoints
        are committed on storage all the same, and the daemon learns of them once etcd is back."""
        with self._lock:
            waiting = sorted(self._unrecorded.items())
        for step, record in waiting:
            try:
                self.client.create(self.keys.ckpt(step), record.SerializeToString())
            except CoordError as exc:
                log.error("agent %s: cannot record checkpoint %d in etcd yet (%s); retrying", self.config.node_id,
                          step, exc, extra={"node": self.config.node_id})
                return
            with self._lock:
                self._unrecorded.pop(step, None)

    def status(self) -> agent_pb2.NodeStatus:
        slowdowns = self.slowdowns()
        stragglers = self.local_stragglers()
        with self._lock:
            group, rnd = self._state.group, self._state.round
            workers = []
            if group is not None:
                for w in group.workers:
                    p = self._state.progress.get(w.rank, Progress())
                    state = agent_pb2.WORKER_RUNNING if w.running else (
                        agent_pb2.WORKER_SUCCEEDED if w.exit and w.exit.kind is ExitKind.SUCCESS
                        else agent_pb2.WORKER_FAILED)
                    if w.running and w.pid in self._state.pending:
                        state = agent_pb2.WORKER_REFORMING
                    workers.append(agent_pb2.WorkerStatus(
                        local_rank=w.local_rank, rank=w.rank, pid=w.pid, state=state, last_step=max(p.step, 0),
                        exit_code=w.exit.returncode if w.exit else 0, exit_reason=w.exit.reason if w.exit else "",
                        slowdown=slowdowns.get(w.local_rank, 0.0), busy_time=p.busy_median(),
                        straggler=w.local_rank in stragglers, round=w.round, reformed=w.reformed))
            draining = self._state.draining
        node = records_pb2.NodeRecord(node_id=self.config.node_id, address=self.address, devices=self.config.workers,
                                      cordoned=draining)
        spares = [agent_pb2.SpareStatus(pid=s.pid, ready=s.warm, age=s.age) for s in self.spare_pool.status()]
        return agent_pb2.NodeStatus(node=node, health=self._health_record(), round=rnd.number if rnd else 0,
                                    workers=workers, draining=draining, spares=spares,
                                    spares_disabled=self.spare_pool.disabled)

    def drain(self, wait: bool, timeout: float) -> tuple[bool, str]:
        """Cordon this node so the daemon leaves it out of the next round, then stop the workers
        (SIGTERM first: the trainer takes its last checkpoint on SIGTERM)."""
        with self._lock:
            self._state.draining = True
        kv = self.client.get(self.keys.node(self.config.node_id))
        if kv is not None:
            record = records_pb2.NodeRecord.FromString(kv.value)
            record.cordoned = True
            self.client.put(self.keys.node(self.config.node_id), record.SerializeToString(), lease=kv.lease)
        self._commands.put(("stop-workers", "draining"))
        if not wait:
            return False, "draining"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._state.group is None or not self._state.group.running:
                    return True, "drained: workers stopped"
            time.sleep(0.05)
        return False, f"workers still running after {timeout:g} s"

    def inject_fault(self, kind: str, device: int, code: int, step: int = 0, factor: float = 0.0) -> str:
        if not self.config.fault_injection:
            raise FaultRefused("fault injection is disabled in this agent's configuration (fault_injection = false)")
        if kind in ("nan-loss", "loss-spike"):
            return self._inject_training_fault(kind, device, step, factor)
        if kind == "slow-worker":
            return self._slow_worker(device, factor)
        if kind == "clear":
            self._clear_throttles()
        if kind == "drop-peers":
            self._drop_peers.set()
            self.metrics.faults.labels(self.config.node_id, "injected-drop-peers").inc()
            return "dropping peer traffic: not answering peers' probes, not reaching them"
        if kind == "clear":
            self._drop_peers.clear()
        if kind == "gpu-hang":
            if not isinstance(self.probe, FakeProbe):
                raise FaultRefused(f"GPU faults can only be injected with the fake probe, not {self.probe.name}")
            self.probe.hang()  # the monitor loop's next sample hangs; the rest of the agent reads the last one
            self.metrics.faults.labels(self.config.node_id, "injected-gpu-hang").inc()
            return "the GPU probe's polls hang until cleared"
        if kind in ("gpu-xid", "gpu-ecc-dbe", "gpu-lost", "clear"):
            if not isinstance(self.probe, FakeProbe):
                if kind == "clear":
                    return "cleared injected faults"
                raise FaultRefused(f"GPU faults can only be injected with the fake probe, not {self.probe.name}")
            if kind == "clear":
                self.probe.clear()
                with self._lock:
                    self._state.worker_findings = []
                detail = "cleared injected faults"
            else:
                fake = {"gpu-xid": "xid", "gpu-ecc-dbe": "ecc-dbe", "gpu-lost": "gpu-lost"}[kind]
                try:
                    finding = self.probe.inject(fake, device, code)
                except ValueError as exc:
                    raise FaultRefused(str(exc)) from exc
                detail = f"injected {finding.code} on device {device} ({finding.severity.name.lower()})"
                self.metrics.faults.labels(self.config.node_id, f"injected-{finding.code}").inc()
            self._poll_probe()
            self._publish_health(force=True)
            return detail
        sig = {"kill-worker": signal.SIGKILL, "hang-worker": signal.SIGSTOP}[kind]
        with self._lock:
            group = self._state.group
        if group is None or not group.signal(device, sig):
            raise FaultRefused(f"no running worker with local rank {device}")
        return f"sent {sig.name} to local rank {device}"

    def _running_worker(self, local_rank: int) -> tuple[int, int]:
        """(rank, pid) of the running worker of ``local_rank``; raises FaultRefused."""
        with self._lock:
            group = self._state.group
            w = group.worker(local_rank) if group is not None else None
            if w is None or not w.running:
                raise FaultRefused(f"no running worker with local rank {local_rank}")
            return w.rank, w.pid

    def _inject_training_fault(self, kind: str, local_rank: int, step: int, factor: float) -> str:
        """Pass a NaN-loss or loss-spike injection to the worker's trainer over its progress stream."""
        rank, _ = self._running_worker(local_rank)
        if kind == "loss-spike" and not factor > 0:
            raise FaultRefused(f"loss-spike needs a factor > 0 (got {factor:g})")
        command = agent_pb2.AgentCommand(inject_fault=agent_pb2.InjectTrainingFault(
            kind="nan" if kind == "nan-loss" else "spike", step=step, factor=factor))
        if not self.channels.send(local_rank, command):
            raise FaultRefused(f"the worker with local rank {local_rank} is not connected to the agent")
        self.metrics.faults.labels(self.config.node_id, f"injected-{kind}").inc()
        log.warning("agent %s: injected %s into rank %d at step %d (factor %g)", self.config.node_id, kind, rank,
                    step, factor, extra={"node": self.config.node_id, "rank": rank, "step": step})
        return f"sent {kind} at step {step} (factor {factor:g}) to local rank {local_rank}"

    def _slow_worker(self, local_rank: int, factor: float) -> str:
        rank, pid = self._running_worker(local_rank)
        try:
            spec = ThrottleSpec(factor, self.config.slow_worker_period)
        except ValueError as exc:
            raise FaultRefused(str(exc)) from None
        with self._lock:
            old = self._throttles.pop(local_rank, None)
            self._throttles[local_rank] = Throttle(pid, spec, rank=rank)
        if old is not None:
            old.stop()
        self.metrics.faults.labels(self.config.node_id, "injected-slow-worker").inc()
        log.warning("agent %s: slowing rank %d down %gx", self.config.node_id, rank, factor,
                    extra={"node": self.config.node_id, "rank": rank})
        return f"slowing local rank {local_rank} down {factor:g}x (SIGSTOP/SIGCONT every {spec.period:g} s)"

    def _clear_throttles(self, keep: dict[int, int] | None = None) -> None:
        """Stop the injected slow-downs, but those of ``keep`` (local rank -> pid still there)."""
        keep = keep or {}
        with self._lock:
            ending = {lr: t for lr, t in self._throttles.items() if keep.get(lr) != t.pgid}
            for lr in ending:
                del self._throttles[lr]
        for t in ending.values():
            t.stop()

    def slowdowns(self) -> dict[int, float]:
        with self._lock:
            return {lr: t.spec.factor for lr, t in self._throttles.items() if t.alive}
