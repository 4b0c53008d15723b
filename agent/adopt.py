"""What a restarted agent needs to adopt the workers its predecessor left running.

An agent is not part of the computation: when it crashes or is restarted (an upgrade), its
workers go on training. It keeps a small state file (``<state_dir>/agent-state.json``, written
atomically after every change of its workers): the node, its lease, the round record, per
local rank the worker's pid and the kernel's start time of that pid, and the same of each warm
spare (a spare lost with its agent would make the node's next round wait for a cold start). A new agent reads it, keeps
only the processes that are still the same ones (same pid *and* same start time, so a recycled pid
is never adopted), resumes the lease if it has not expired, and carries on the round in place.

Adopted processes are not children of the new agent, so their exit status cannot be read; a
:class:`AdoptedProcess` waits for their end through a pidfd.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import subprocess
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STATE_NAME = "agent-state.json"
STATE_VERSION = 1


class StateFileError(ValueError):
    """The state file exists but cannot be used (malformed, another node's or job's)."""


@dataclass(frozen=True)
class WorkerEntry:
    local_rank: int
    rank: int
    pid: int
    start_time: int  # /proc/<pid>/stat field 22, clock ticks since boot
    log_path: str
    can_reform: bool = False


@dataclass(frozen=True)
class SpareEntry:
    pid: int
    start_time: int
    log_path: str
    warm: bool = False  # connected and warm: its successor waits a moment for it to reconnect


@dataclass(frozen=True)
class AgentState:
    job: str
    node_id: str
    lease_id: int
    round: bytes  # the serialized RoundRecord the workers train in (b"": none)
    workers: tuple[WorkerEntry, ...] = field(default_factory=tuple)
    restarts: int = 0
    spares: tuple[SpareEntry, ...] = field(default_factory=tuple)

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["version"] = STATE_VERSION
        doc["round"] = base64.b64encode(self.round).decode()
        doc["workers"] = [asdict(w) for w in self.workers]
        doc["spares"] = [asdict(s) for s in self.spares]
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> AgentState:
        try:
            doc = json.loads(raw)
            if doc.get("version") != STATE_VERSION:
                raise StateFileError(f"version {doc.get('version')!r}, expected {STATE_VERSION}")
            return cls(job=str(doc["job"]), node_id=str(doc["node_id"]), lease_id=int(doc["lease_id"]),
                       round=base64.b64decode(doc["round"]), restarts=int(doc.get("restarts", 0)),
                       workers=tuple(WorkerEntry(**w) for w in doc["workers"]),
                       spares=tuple(SpareEntry(**s) for s in doc.get("spares", [])))
        except StateFileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateFileError(f"malformed: {exc}") from exc


def state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATE_NAME


def save_state(path: Path, state: AgentState) -> None:
    """Write ``state`` atomically (a crash leaves the old file or the new one, never half)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(state.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def load_state(path: Path, job: str, node_id: str) -> AgentState | None:
    """The predecessor's state, or None when there is none. Raises ``StateFileError`` for a file
    that is malformed or belongs to another job or node (the caller logs and starts fresh)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    state = AgentState.from_json(raw)
    if state.job != job or state.node_id != node_id:
        raise StateFileError(f"written for job {state.job!r} node {state.node_id!r}, not job {job!r} node {node_id!r}")
    return state


def clear_state(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), or None when there is no such process.
    With the pid it names one process for the life of the machine."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 2 (the command name) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None  # a zombie is dead; its parent has not reaped it yet
    return int(fields[19])


def alive_and_same(entry: WorkerEntry | SpareEntry) -> bool:
    return process_start_time(entry.pid) == entry.start_time


class AdoptedProcess:
    """A live process this agent did not start: enough of ``subprocess.Popen`` for ``Worker``
    (``pid``, ``wait()``, ``returncode``). Its exit status is unknown (``returncode`` stays
    None after ``wait``) because only its parent can read it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._watched = False
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # already gone: wait() returns at once

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the process ends (the worker's watching thread does this); with
        ``timeout``, wait for that thread to see the end, or raise ``subprocess.TimeoutExpired``."""
        with self._lock:
            watcher = timeout is None and not self._watched
            self._watched = self._watched or watcher
        if timeout is not None or not watcher:  # the watching thread reads the pidfd
            if not self._ended.wait(timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            return self.returncode
        if self._fd is not None:
            try:
                select.select([self._fd], [], [])
            finally:
                os.close(self._fd)
                self._fd = None
        self._ended.set()
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode
