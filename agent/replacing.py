"""Warm spares, readiness to join and worker exits: the part of the node agent that replaces what is lost.

Spares start only when ``core.spares_may_start`` allows. A node outside an open round warms a
spare per worker before it says it is ready to join (``core.join_readiness``); one that lost a
worker with no warm spare leaves the world while one warms ("replacing"). A worker's exit is
refilled in place (``core.refill_in_place``), fails the round, or is the job giving up. Workers
are stopped here too: in the background but for a drain or a shutdown, so that the main loop never
waits on one that cannot act on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from stalwart.agent.config import AgentConfig
from stalwart.agent.core import JoinFacts, join_readiness, refill_in_place, spares_may_start
from stalwart.agent.health import Finding, Severity
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.preload import Preloader
from stalwart.agent.priority import can_restore_priority
from stalwart.agent.spares import SparePool
from stalwart.agent.stall import StallDetector
from stalwart.agent.state import NodeState, Progress
from stalwart.agent.workers import ExitKind, Worker, WorkerExit, start_spare, stop_workers

log = logging.getLogger(__name__)


class ReplacingMixin:
    """Mixed into :class:`~stalwart.agent.node.NodeAgent`: its spares, readiness and worker exits."""

    # What it uses of NodeAgent (agent/node.py): attributes set in its __init__ ...
    config: AgentConfig
    stalls: StallDetector
    metrics: AgentMetrics
    spare_pool: SparePool
    preloader: Preloader | None
    _state: NodeState
    _lock: threading.RLock
    _commands: queue.Queue[tuple[str, object]]
    _last_progress_write: float

    if TYPE_CHECKING:  # ... and the methods it calls that node.py or another part defines
        def _worker_env(self) -> dict[str, str]: ...
        def _publish_health(self, force: bool = False) -> None: ...
        def _publish_progress_safe(self) -> None: ...
        def _clear_throttles(self, keep: dict[int, int] | None = None) -> None: ...

    @functools.cached_property
    def _spare_nice(self) -> int:
        """The nice value spares warm at: ``spare_nice`` where their priority can be given back."""
        if self.config.spare_nice and not can_restore_priority():
            log.info("agent %s: spares warm at the workers' priority: this agent may not raise a priority "
                     "again (spare_nice needs root or RLIMIT_NICE >= 20)", self.config.node_id,
                     extra={"node": self.config.node_id})
            return 0
        return self.config.spare_nice

    def _start_spare(self) -> Worker:
        nice = 0 if self._awaiting_spares() else self._spare_nice
        return start_spare(self.config.command, self.config.log_dir, self._spare_exited,
                           extra_env=self._worker_env(), cwd=self.config.cwd, nice=nice,
                           preloader=self.preloader)

    def _awaiting_spares(self) -> bool:
        """The node is out of the world until its spares are warm (replacing a lost worker, or
        warming to join): their warm-up is then what it waits for, not a side job."""
        return self._state.replacing_since is not None or self._state.warming_since is not None

    def _maintain_spares(self) -> None:
        if self._awaiting_spares():
            for spare in self.spare_pool.workers():
                if spare.niced and spare.running:
                    spare.restore_priority()
        if self.spare_pool.wanted and not self._state.draining and self._spares_may_start():
            self.spare_pool.maintain()
        self._spare_metrics()
        self._replacement_warm()
        was = self._state.warming_since
        self._update_readiness()
        if was is not None and self._state.warming_since is None:
            self._publish_health(force=True)

    def _spares_may_start(self) -> bool:
        with self._lock:
            group = self._state.group
            running = [w for w in group.workers if w.running] if group is not None else []
            stepped = sum(1 for w in running if self._state.progress.get(w.rank, Progress()).step >= 0)
            return spares_may_start(warming=self._state.warming_since is not None,
                                    replacing=self._state.replacing_since is not None, workers=len(running),
                                    stepped=stepped, niced=self._spare_nice > 0)

    def _spare_metrics(self) -> None:
        spares = self.spare_pool.status()
        ready = sum(1 for s in spares if s.warm)
        self.metrics.spares.labels(self.config.node_id, "ready").set(ready)
        self.metrics.spares.labels(self.config.node_id, "starting").set(len(spares) - ready)

    def _replacement_warm(self) -> None:
        """End "replacing" once a spare per local worker is ready (or it took too long); the
        daemon may then take the node back into the world."""
        with self._lock:
            since = self._state.replacing_since
            if since is None:
                return
            ready = sum(1 for s in self.spare_pool.status() if s.warm)
            if ready >= self.config.workers:
                self._end_replacing(f"{ready} warm spare(s) ready after {time.monotonic() - since:.1f} s")
            elif self.spare_pool.disabled:
                self._end_replacing(f"no warm spares: {self.spare_pool.disabled}")
            elif time.monotonic() - since > self.config.replace_timeout:
                self._end_replacing(f"no warm replacement within replace_timeout={self.config.replace_timeout:g} s")
            else:
                return
        self._publish_health(force=True)

    def _end_replacing(self, why: str) -> None:
        """Caller holds the lock."""
        self._state.replacing_since = None
        if self._state.warming_since is None:
            self.spare_pool.wanted = self.config.spares if self.config.reform_in_place else 0
        log.info("agent %s: no longer replacing a lost worker: %s", self.config.node_id, why,
                 extra={"node": self.config.node_id})

    def _update_readiness(self) -> None:
        """Warm a spare per local worker while this node is outside an open round and not ready
        to join (``core.join_readiness``); its health record says ``replacing`` meanwhile, so the
        daemon admits the node only once it can join warm."""
        with self._lock:
            # the newest round read, even before the main loop applied it: a node that just started
            # must not say it is ready because it has not applied the round yet
            rnd = self._state.seen_round
            now = time.monotonic()
            warming = self._state.warming_since
            applied = self._state.round
            # Workers count as warm only while the round has not moved on past theirs: a node left
            # out of a newer round stops them when it applies that round.
            moved_on = rnd is not None and (applied is None or rnd.number > applied.number)
            facts = JoinFacts(
                in_round=rnd is not None and not rnd.closed
                and any(m.node_id == self.config.node_id for m in rnd.members),
                started=rnd is not None, workers=self.config.workers,
                ready_spares=sum(1 for sp in self.spare_pool.status() if sp.warm) + sum(
                    1 for w in (self._state.group.workers if self._state.group is not None and not moved_on else [])
                    if w.running and not w.stopping and w.pid in self._state.can_reform),
                # spares = 0: the command is not known to run as a spare, so there is nothing to warm
                spares_disabled=bool(self.spare_pool.disabled) or self.config.spares == 0,
                reform_in_place=self.config.reform_in_place,
                warming_for=None if warming is None else now - warming)
            readiness = join_readiness(facts, self.config.replace_timeout)
            if readiness.ready and warming is not None:
                self._state.warming_since = None
                if self._state.replacing_since is None:
                    self.spare_pool.wanted = self.config.spares if self.config.reform_in_place else 0
                log.info("agent %s: ready to join: %s", self.config.node_id, readiness.why,
                         extra={"node": self.config.node_id})
            elif not readiness.ready and warming is None:
                self._state.warming_since = now
                self.spare_pool.wanted = max(self.spare_pool.wanted, self.config.workers)
                log.info("agent %s: outside round %d, not ready to join: %s", self.config.node_id,
                         rnd.number if rnd else 0, readiness.why, extra={"node": self.config.node_id})
            else:
                return
        self._commands.put(("call", lambda: None))  # wake the main loop to start spares

    def _start_replacing(self, exit_: WorkerExit, could_reform: bool) -> None:
        """A worker of this round died: with no ready spare to take its rank, ask to leave the world
        while spares warm up, so the other ranks need not wait for a cold process. Only for
        workers that re-form in place (the survivors then re-form instead of restarting).
        Caller holds the lock."""
        if exit_.kind in (ExitKind.SIGNAL, ExitKind.OOM_KILLED, ExitKind.USER_ERROR):
            self._replace_out_of_world(exit_.rank, exit_.round, could_reform, "lost")

    def _replace_out_of_world(self, rank: int, round_number: int, could_reform: bool, what: str) -> None:
        """Ask to leave the world while spares warm (see :meth:`_start_replacing`) for a worker
        that is lost (``what``: "lost", "stopped"). Caller holds the lock."""
        if not (self.config.reform_in_place and could_reform and not self.spare_pool.disabled
                and self._state.replacing_since is None):
            return
        if any(s.warm for s in self.spare_pool.status()):
            return  # a warm spare takes the rank in the next round
        self._state.replacing_since = time.monotonic()
        self.spare_pool.wanted = max(self.spare_pool.wanted, self.config.workers)
        log.info("agent %s: rank %d %s with no warm spare ready: replacing it out of the world", self.config.node_id,
                 rank, what, extra={"node": self.config.node_id, "rank": rank, "round": round_number})
        self._commands.put(("call", lambda: None))  # wake the main loop to start spares

    def _spare_exited(self, exit_: WorkerExit) -> None:
        """A spare's exit: not a worker failure (it held no rank); the pool replaces it."""
        with self._lock:
            self._state.can_reform.discard(exit_.pid)
        if self.spare_pool.exited(exit_.pid):
            self.metrics.faults.labels(self.config.node_id, f"spare-{exit_.kind.value}").inc()
        self._commands.put(("call", lambda: None))  # wake the main loop to start a replacement

    def _stop_workers(self, why: str, wait: bool = False) -> None:
        self._clear_throttles()  # an injected slow-down ends with the workers it slowed
        with self._lock:
            group = self._state.group
            self._state.group = None
            self._state.pending = {}
        if group is not None and group.running:
            log.info("agent %s: stopping workers: %s", self.config.node_id, why)
            if wait:
                group.stop(self.config.stop_grace)
            else:
                self._stop_in_background(group.workers, self.config.stop_grace)
        if group is not None:
            for w in group.workers:
                self.stalls.forget(w.rank)

    def _stop_in_background(self, workers: list[Worker], grace: float) -> None:
        """SIGTERM now; the grace and the SIGKILL after it on a thread of their own, so the main loop
        (which applies the next round) is never held up by a worker that ignores SIGTERM — one
        blocked in a collective with peers that are gone cannot act on it until that times out."""
        workers = [w for w in workers if w.running]
        if not workers:
            return
        for w in workers:
            w.stopping = True  # from now on, for every check of the main loop
        threading.Thread(target=stop_workers, args=(workers, grace), daemon=True, name="agent-stop").start()

    def _worker_exited(self, exit_: WorkerExit) -> None:
        with self._lock:
            self._state.exits.append(exit_)
            pending = self._state.pending.pop(exit_.pid, None)
            could_reform = exit_.pid in self._state.can_reform
            self._state.can_reform.discard(exit_.pid)
            group = self._state.group
            current = group.worker(exit_.local_rank) if group is not None else None
            if current is None or current.pid == exit_.pid:  # not a replaced process's late exit
                self.stalls.forget(exit_.rank)
            if exit_.kind in (ExitKind.SUCCESS, ExitKind.STOPPED):
                return
            warm_spare = any(s.warm for s in self.spare_pool.status())
            if pending is not None and exit_.kind is not ExitKind.GAVE_UP and refill_in_place(
                    joining=pending.joining, new_rank=pending.rank, warm_spare=warm_spare, spares=self.config.spares):
                # Died before it began its re-form (it may have been dying already when the round
                # came, or its old world's abort took it down): fill its place here, with a warm
                # spare, instead of failing the round (``core.refill_in_place`` says when).
                log.error("agent %s: rank %d (pid %d) died while re-forming into round %d (%s); replacing it",
                          self.config.node_id, exit_.rank, exit_.pid, pending.round, exit_.reason,
                          extra={"node": self.config.node_id, "rank": exit_.rank, "round": pending.round})
                self.metrics.reforms.labels(self.config.node_id, "died").inc()
                self._commands.put(("refill", (pending.round, pending.local_rank, exit_.pid)))
                return
            if pending is not None and exit_.kind is not ExitKind.GAVE_UP:
                # It died while joining (its peers' group may be broken), or there is no warm
                # spare (a new process would hold every peer up for its whole start): fail the
                # round it was joining; without a warm spare the node also leaves while one warms.
                log.error("agent %s: rank %d (pid %d) died while re-forming into round %d (%s); failing the round%s",
                          self.config.node_id, exit_.rank, exit_.pid, pending.round, exit_.reason,
                          "" if warm_spare else " and leaving it while a spare warms",
                          extra={"node": self.config.node_id, "rank": exit_.rank, "round": pending.round})
                self.metrics.reforms.labels(self.config.node_id, "died").inc()
                exit_ = dataclasses.replace(exit_, round=pending.round)
                could_reform = True  # it was re-forming in place
            if exit_.kind is ExitKind.GAVE_UP:
                # Not a worker failure (the daemon would restart the round): the job gave up.
                self._state.gave_up = f"rank {exit_.rank}: {exit_.reason}"
                self._state.worker_findings.append(Finding("worker", exit_.local_rank, Severity.OK, "job-gave-up",
                                                           self._state.gave_up, exit_.round))
                self.metrics.faults.labels(self.config.node_id, "job-gave-up").inc()
                log.error("agent %s: %s; the job gave up, not asking for a restart", self.config.node_id,
                          self._state.gave_up, extra={"node": self.config.node_id, "rank": exit_.rank,
                                                      "round": exit_.round})
                self._last_progress_write = 0.0
            else:
                if current is not None and current.pid == exit_.pid:
                    self._start_replacing(exit_, could_reform)
                self.metrics.faults.labels(self.config.node_id, f"worker-{exit_.kind.value}").inc()
                self._state.worker_findings.append(Finding("worker", exit_.local_rank, Severity.OK,
                                                           f"worker-{exit_.kind.value}",
                                                           f"rank {exit_.rank}: {exit_.reason}", exit_.round))
        self._publish_health(force=True)
        if exit_.kind is ExitKind.GAVE_UP:
            self._publish_progress_safe()
