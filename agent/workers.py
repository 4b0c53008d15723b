"""The node's worker processes for one round: start with torchrun's environment, watch, stop.

Each worker runs in its own process group (its session leader), so stopping it reaches every
process it started. Workers outlive their agent: an agent that crashes or is restarted is not
part of the computation, and its successor adopts them (:mod:`stalwart.agent.adopt`). Warm spares,
which hold no rank, get a parent-death signal (SIGKILL) instead: they die with the agent that
started them. Exits are noticed by one waiting thread per worker, so a dead worker is reported as
soon as the kernel reaps it (for an adopted one, as soon as its pidfd says it ended).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from stalwart.agent.adopt import AdoptedProcess
from stalwart.agent.preload import ForkedProcess, Preloader
from stalwart.agent.priority import set_autogroup_nice
from stalwart.coord.local import die_with_parent
from stalwart.proto.contract import ENV_RESTORE_STEP, ENV_ROUND, ENV_SPARE, EXIT_DIVERGED, EXIT_STUCK

log = logging.getLogger(__name__)

# EXIT_DIVERGED (stalwart.proto.contract): the trainer stopped on repeated training-health faults
# (NaN or spiking loss); the job gave up and must not be restarted.


class ExitKind(Enum):
    SUCCESS = "success"
    USER_ERROR = "user-error"  # non-zero exit code
    GAVE_UP = "gave-up"  # EXIT_DIVERGED: the job gave up, do not restart
    SIGNAL = "signal"
    OOM_KILLED = "oom-killed"
    STOPPED = "stopped"  # ended by the agent (round change, drain, shutdown)


@dataclass(frozen=True)
class WorkerExit:
    local_rank: int
    rank: int
    pid: int
    returncode: int
    kind: ExitKind
    reason: str
    at: float
    round: int = 0


@dataclass(frozen=True)
class RoundAssignment:
    """What this node runs in a round: the torchrun environment of each local worker."""

    round: int
    group_rank: int  # this node's rank among nodes
    first_rank: int  # global rank of local rank 0
    local_world_size: int
    world_size: int
    master_addr: str
    master_port: int
    restore_step: int | None = None
    restart_count: int = 0

    def env(self, local_rank: int) -> dict[str, str]:
        rank = self.first_rank + local_rank
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(max(1, self.world_size // max(1, self.local_world_size))),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "",
            ENV_ROUND: str(self.round),
        }
        if self.restore_step is not None:
            env[ENV_RESTORE_STEP] = str(self.restore_step)
        return env


def _oom_kills() -> int:
    """OOM kills in this cgroup so far (cgroup v2), to tell an OOM SIGKILL from any other."""
    try:
        with open("/proc/self/cgroup") as f:
            path = f.read().strip().split("::", 1)[-1]
        with open(f"/sys/fs/cgroup{path}/memory.events") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def classify(returncode: int, stopping: bool, oom_before: int) -> tuple[ExitKind, str]:
    if stopping:
        return ExitKind.STOPPED, f"stopped by the agent (exit status {returncode})"
    if returncode == 0:
        return ExitKind.SUCCESS, "success"
    if returncode == EXIT_DIVERGED:
        return ExitKind.GAVE_UP, f"the job gave up: training diverged (exit code {EXIT_DIVERGED})"
    if returncode == EXIT_STUCK:
        return ExitKind.USER_ERROR, (f"stuck in a collective on a hung peer past the abort of its world "
                                     f"(exit code {EXIT_STUCK})")
    if returncode > 0:
        return ExitKind.USER_ERROR, f"exit code {returncode}"
    sig = -returncode
    if sig == signal.SIGKILL and _oom_kills() > oom_before:
        return ExitKind.OOM_KILLED, "killed by the kernel's OOM killer"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return ExitKind.SIGNAL, f"killed by {name}"


# torchrun's per-rank variables: a warm spare has no rank yet, so it must not inherit any.
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", ENV_ROUND, ENV_RESTORE_STEP,
             "TORCHELASTIC_RESTART_COUNT")


class Worker:
    """One supervised process. Its rank, local rank, round and exit handler can change while it
    lives: a kept worker moves from round to round, a warm spare becomes a worker. The waiting
    thread reads them when the process exits, so the exit is reported with its latest place."""

    def __init__(self, local_rank: int, rank: int, proc: subprocess.Popen[bytes] | AdoptedProcess | ForkedProcess,
                 log_path: Path, *,
                 round: int = 0, spare: bool = False, on_exit: Callable[[WorkerExit], None] | None = None,
                 oom_before: int = 0) -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.proc = proc
        self.log_path = log_path
        self.round = round
        self.spare = spare
        self.stopping = False
        self.exit: WorkerExit | None = None
        self.started_at = time.monotonic()
        self.reformed = False  # kept from an earlier round or taken from the spares
        self.warming = False  # a spare taken before it said it was warm, until it does
        self.on_exit = on_exit
        self._oom_before = oom_before
        self.goodbye = ""  # the reason of the worker's Goodbye, if it said one (an adopted one's only clue)
        self.niced = False  # a spare warming below the workers' priority (start_spare)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.exit is None

    def watch(self) -> None:
        threading.Thread(target=self._wait, daemon=True, name=f"worker-wait {self.pid}").start()

    def _wait(self) -> None:
        status = self.proc.wait()
        if status is None:  # adopted: not our child, its exit status is unknown
            returncode, (kind, reason) = -1, _adopted_exit(self.goodbye, self.stopping)
        else:
            returncode = status
            kind, reason = classify(returncode, self.stopping, self._oom_before)
        self.exit = WorkerExit(self.local_rank, self.rank, self.pid, returncode, kind, reason, time.time(),
                               self.round)
        level = logging.INFO if kind in (ExitKind.SUCCESS, ExitKind.STOPPED) else logging.ERROR
        what = "spare" if self.spare else f"rank {self.rank}"
        log.log(level, "round %d: %s (pid %d) exited: %s", self.round, what, self.pid, reason,
                extra={"round": self.round, "rank": self.rank})
        handler = self.on_exit
        if handler is None:
            return
        try:
            handler(self.exit)
        except Exception:
            log.exception("worker exit handler failed")

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the worker's process group."""
        if not self.running:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def dump_then_kill(self, delay: float = 0.5) -> None:
        """SIGUSR2 (a stalwart trainer dumps every thread's stack to its log: where it was stuck),
        then :meth:`kill` ``delay`` seconds later, off the caller's thread."""
        self.stopping = True
        try:
            os.kill(self.pid, signal.SIGUSR2)
        except ProcessLookupError:
            return
        timer = threading.Timer(delay, self.kill)
        timer.daemon = True
        timer.start()

    def restore_priority(self) -> None:
        """Back to the workers' priority (nice 0), every thread and child of the process group:
        a spare warms at a lower one (:func:`start_spare`) and must not keep it as a rank, or the
        world would wait on it every step."""
        self.niced = False
        try:
            os.setpriority(os.PRIO_PGRP, self.pid, 0)
            set_autogroup_nice(self.pid, 0)
        except OSError as exc:
            log.warning("cannot give pid %d its workers' priority back: %s", self.pid, exc)

    def kill(self) -> None:
        """SIGKILL now, as the agent's own decision (the exit is STOPPED, not a failure)."""
        self.stopping = True
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass


def _adopted_exit(goodbye: str, stopping: bool) -> tuple[ExitKind, str]:
    """How an adopted worker ended, from what it said before it went (its status is unknown)."""
    if stopping:
        return ExitKind.STOPPED, "stopped by the agent (adopted; exit status unknown)"
    if goodbye == "finished":
        return ExitKind.SUCCESS, "success (adopted; it said it finished)"
    if goodbye == "diverged":
        return ExitKind.GAVE_UP, "the job gave up: training diverged (adopted worker)"
    return ExitKind.USER_ERROR, "exited (adopted after an agent restart; exit status unknown)"


def _spawn(command: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: str | None, *,
           die_with_agent: bool = False,
           preloader: Preloader | None = None) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start ``command``: forked from the preload process when one is ready, else cold."""
    if preloader is not None and not die_with_agent:
        forked = preloader.spawn(env, log_path, cwd)
        if forked is not None:
            return forked
    argv = die_with_parent(list(command)) if die_with_agent else list(command)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_spare(command: Sequence[str], log_dir: Path, on_exit: Callable[[WorkerExit], None], *,
                extra_env: Mapping[str, str] | None = None, cwd: str | None = None, nice: int = 0,
                preloader: Preloader | None = None) -> Worker:
    """Start a warm spare: the worker command with ``STALWART_SPARE=1`` and no rank. It imports
    and builds what it can, then waits on the progress channel for a rank. Like a worker it
    outlives its agent (a restarted agent adopts it; one gone for good orphans it, and it stops
    itself after ``STALWART_ORPHAN_TIMEOUT``). ``nice`` > 0: it warms at that nice value (its
    whole process group), using what CPU the node's workers leave; taking it as a rank restores
    the workers' priority."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(extra_env or {})
    env[ENV_SPARE] = "1"
    spare_dir = log_dir / "spares"
    spare_dir.mkdir(parents=True, exist_ok=True)
    log_path = spare_dir / f"spare-{time.time_ns()}.log"
    proc = _spawn(command, env, log_path, cwd, preloader=preloader)
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PGRP, proc.pid, nice)  # its own session: the group is its pid
            set_autogroup_nice(proc.pid, nice)
        except OSError as exc:
            log.warning("cannot lower the priority of spare pid %d: %s", proc.pid, exc)
    final = spare_dir / f"spare-{proc.pid}.log"
    try:
        log_path.rename(final)  # the open file follows the rename
        log_path = final
    except OSError:
        pass
    worker = Worker(-1, -1, proc, log_path, spare=True, on_exit=on_exit, oom_before=_oom_kills())
    worker.niced = nice > 0
    worker.watch()
    log.info("started a warm spare (pid %d), log %s", proc.pid, log_path)
    return worker


def stop_workers(workers: Sequence[Worker], grace: float) -> list[WorkerExit]:
    """SIGTERM each worker's process group, SIGKILL what is left after ``grace`` seconds."""
    for w in workers:
        if w.running:
            w.stopping = True
            for sig in (signal.SIGTERM, signal.SIGCONT):  # a stopped process must wake to die
                try:
                    os.killpg(w.pid, sig)
                except ProcessLookupError:
                    pass
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("round %d: rank %d ignored SIGTERM for %.1f s; killing it", w.round, w.rank, grace,
                        extra={"round": w.round, "rank": w.rank})
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.proc.wait()
        try:  # anything the worker left in its group
            os.killpg(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 2
    while any(w.exit is None for w in workers) and time.monotonic() < end:
        time.sleep(0.01)  # let the waiting threads record the exits
    return [w.exit for w in workers if w.exit is not None]


class WorkerGroup:
    """The workers of one round, by local rank. ``on_exit`` is called from a waiting thread for
    every exit.

    ``reuse`` maps local ranks to live processes that take those places instead of new ones (a
    worker kept from the previous round, a warm spare); the caller tells them their new place.
    With ``spawn_missing=False`` the other local ranks stay empty until :meth:`spawn` or
    :meth:`adopt` fills them.

    Spares adopted into it were created on the agent's main loop: their parent-death signal
    fires when the creating *thread* ends.
    """

    def __init__(
        self,
        command: Sequence[str],
        assignment: RoundAssignment,
        log_dir: Path,
        on_exit: Callable[[WorkerExit], None],
        *,
        extra_env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        reuse: Mapping[int, Worker] | None = None,
        spawn_missing: bool = True,
        preloader: Preloader | None = None,
    ) -> None:
        self.assignment = assignment
        self._command = list(command)
        self._extra_env = dict(extra_env or {})
        self._cwd = cwd
        self._preloader = preloader
        self._slots: dict[int, Worker] = {}
        self._on_exit = on_exit
        self._oom_before = _oom_kills()
        self._round_dir = log_dir / f"round-{assignment.round:06d}"
        self._round_dir.mkdir(parents=True, exist_ok=True)
        for local_rank, worker in sorted((reuse or {}).items()):
            self.adopt(local_rank, worker)
        if spawn_missing:
            for local_rank in range(assignment.local_world_size):
                if local_rank not in self._slots:
                    self.spawn(local_rank)

    @property
    def workers(self) -> list[Worker]:
        return [self._slots[lr] for lr in sorted(self._slots)]

    def worker(self, local_rank: int) -> Worker | None:
        return self._slots.get(local_rank)

    def missing(self) -> list[int]:
        """Local ranks of this round without a process."""
        return [lr for lr in range(self.assignment.local_world_size) if lr not in self._slots]

    def _log_path(self, rank: int) -> Path:
        path = self._round_dir / f"rank-{rank:05d}.log"
        n = 1
        while path.exists() or path.is_symlink():
            path = self._round_dir / f"rank-{rank:05d}.{n}.log"
            n += 1
        return path

    def spawn(self, local_rank: int) -> Worker:
        """Start a new process for ``local_rank`` with the round's torchrun environment."""
        a = self.assignment
        env = dict(os.environ)
        env.update(self._extra_env)
        env.update(a.env(local_rank))
        log_path = self._round_dir / f"rank-{a.first_rank + local_rank:05d}.log"
        if log_path.is_symlink():  # a kept worker's log: the new process writes its own
            log_path = self._log_path(a.first_rank + local_rank)
        proc = _spawn(self._command, env, log_path, self._cwd, preloader=self._preloader)
        worker = Worker(local_rank, a.first_rank + local_rank, proc, log_path, round=a.round, on_exit=self._on_exit,
                        oom_before=self._oom_before)
        self._slots[local_rank] = worker
        worker.watch()
        log.info("round %d: started rank %d (pid %d), log %s", a.round, worker.rank, proc.pid, log_path,
                 extra={"round": a.round, "rank": worker.rank})
        return worker

    def adopt(self, local_rank: int, worker: Worker) -> Worker:
        """Give ``local_rank`` of this round to a live process. A spare's log moves to the round's
        naming; a kept worker's log stays where it is and the round's name links to it."""
        a = self.assignment
        worker.local_rank, worker.rank, worker.round = local_rank, a.first_rank + local_rank, a.round
        worker.on_exit = self._on_exit
        worker.reformed = True
        path = self._log_path(worker.rank)
        try:
            if worker.spare:
                worker.log_path.rename(path)
                worker.log_path = path
            else:
                path.symlink_to(worker.log_path.resolve())
        except OSError as exc:
            log.warning("round %d: cannot name the log of rank %d: %s", a.round, worker.rank, exc)
        worker.spare = False
        self._slots[local_rank] = worker
        return worker

    def place(self, local_rank: int, worker: Worker) -> Worker:
        """Put a worker that already runs this round at ``local_rank`` (adopted after an agent
        restart): its place and log stay as they are."""
        worker.on_exit = self._on_exit
        self._slots[local_rank] = worker
        return worker

    def release(self, local_rank: int) -> Worker | None:
        """Take a worker out of the group (it is being stopped or replaced by the caller)."""
        return self._slots.pop(local_rank, None)

    def signal(self, local_rank: int, sig: int) -> bool:
        """Send ``sig`` to one worker's process group (fault injection: SIGKILL, SIGSTOP)."""
        worker = self._slots.get(local_rank)
        return worker is not None and worker.signal(sig)

    def stop(self, grace: float) -> list[WorkerExit]:
        """SIGTERM every worker's process group, SIGKILL what is left after ``grace`` seconds."""
        return stop_workers(self.workers, grace)

    @property
    def running(self) -> bool:
        return any(w.running for w in self._slots.values())
