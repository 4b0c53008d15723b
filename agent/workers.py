"""The node's worker processes for one round: start with torchrun's environment, watch, stop.

Each worker runs in its own process group (its session leader), so stopping it reaches every
process it started. Each worker also gets a parent-death signal (SIGKILL): if the agent dies,
the kernel kills its workers at once, and a worker that wants its own children to follow it
does the same (the trainer sets it for its helpers). Exits are noticed by one waiting thread per
worker, so a dead worker is reported as soon as the kernel reaps it.
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

from stalwart.coord.local import die_with_parent

log = logging.getLogger(__name__)

# The trainer's exit status when it stops on repeated training-health faults (NaN or spiking
# loss): the job gave up and must not be restarted. Same value as ``stalwart.trainer.EXIT_DIVERGED``
# (defined there; kept here too so the agent does not import the trainer and its torch).
EXIT_DIVERGED = 3


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
            "STALWART_ROUND": str(self.round),
        }
        if self.restore_step is not None:
            env["STALWART_RESTORE_STEP"] = str(self.restore_step)
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


class Worker:
    def __init__(self, local_rank: int, rank: int, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.proc = proc
        self.log_path = log_path
        self.stopping = False
        self.exit: WorkerExit | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.exit is None


class WorkerGroup:
    """The workers of one round. ``on_exit`` is called from a waiting thread for every exit.

    Create it from a thread that lives as long as the workers should (the agent's main loop):
    the kernel's parent-death signal fires when the creating *thread* ends.
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
    ) -> None:
        self.assignment = assignment
        self.workers: list[Worker] = []
        self._on_exit = on_exit
        self._oom_before = _oom_kills()
        self._lock = threading.Lock()
        round_dir = log_dir / f"round-{assignment.round:06d}"
        round_dir.mkdir(parents=True, exist_ok=True)
        for local_rank in range(assignment.local_world_size):
            env = dict(os.environ)
            env.update(extra_env or {})
            env.update(assignment.env(local_rank))
            log_path = round_dir / f"rank-{assignment.first_rank + local_rank:05d}.log"
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(die_with_parent(list(command)), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            worker = Worker(local_rank, assignment.first_rank + local_rank, proc, log_path)
            self.workers.append(worker)
            threading.Thread(target=self._wait, args=(worker,), daemon=True,
                             name=f"worker-wait {worker.rank}").start()
            log.info("round %d: started rank %d (pid %d), log %s", assignment.round, worker.rank, proc.pid,
                     log_path, extra={"round": assignment.round, "rank": worker.rank})

    def _wait(self, worker: Worker) -> None:
        returncode = worker.proc.wait()
        kind, reason = classify(returncode, worker.stopping, self._oom_before)
        worker.exit = WorkerExit(worker.local_rank, worker.rank, worker.pid, returncode, kind, reason, time.time(),
                                 self.assignment.round)
        level = logging.INFO if kind in (ExitKind.SUCCESS, ExitKind.STOPPED) else logging.ERROR
        log.log(level, "round %d: rank %d (pid %d) exited: %s", self.assignment.round, worker.rank, worker.pid,
                reason, extra={"round": self.assignment.round, "rank": worker.rank})
        try:
            self._on_exit(worker.exit)
        except Exception:
            log.exception("worker exit handler failed")

    def signal(self, local_rank: int, sig: int) -> bool:
        """Send ``sig`` to one worker's process group (fault injection: SIGKILL, SIGSTOP)."""
        worker = self.workers[local_rank]
        if not worker.running:
            return False
        try:
            os.killpg(worker.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def stop(self, grace: float) -> list[WorkerExit]:
        """SIGTERM every worker's process group, SIGKILL what is left after ``grace`` seconds."""
        for w in self.workers:
            if w.running:
                w.stopping = True
                for sig in (signal.SIGTERM, signal.SIGCONT):  # a stopped process must wake to die
                    try:
                        os.killpg(w.pid, sig)
                    except ProcessLookupError:
                        pass
        deadline = time.monotonic() + grace
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("round %d: rank %d ignored SIGTERM for %.1f s; killing it", self.assignment.round,
                            w.rank, grace)
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
        while any(w.exit is None for w in self.workers) and time.monotonic() < end:
            time.sleep(0.01)  # let the waiting threads record the exits
        return [w.exit for w in self.workers if w.exit is not None]

    @property
    def running(self) -> bool:
        return any(w.running for w in self.workers)
