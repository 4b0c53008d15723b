"""The TCP connections of this process's current world, so that leaving it can cut them.

Why: gloo has no abort. A rank that leaves a world (its collective failed, or the world changes)
destroys its process groups, but torch keeps a group's connections open while anything still
refers to it, so a peer blocked in a receive from this rank waits for its collective timeout
(``collective_timeout_s``, 30 s) before it can re-form too. Shutting the connections down makes
that receive fail at once. The world's connections are told apart from the process's other
sockets by when they were opened: between the start of the join and the end of the world's first
step (every group, DeepSpeed's included, is connected by then), less those of the rendezvous
store, which rank 0 keeps hosting across rounds. Linux only (``/proc/self/fd``); elsewhere
nothing is recorded and nothing is cut.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator

__all__ = ["WorldSockets", "world_sockets"]

log = logging.getLogger(__name__)


class WorldSockets:
    """:meth:`joining` before a world's first connection, :meth:`ready` after its first step,
    :meth:`cut` when leaving it."""

    def __init__(self) -> None:
        self._before: set[int] | None = None
        self._world: set[int] = set()
        self._lock = threading.Lock()  # the main thread records, a stuck-step watcher may cut

    @property
    def recording(self) -> bool:
        return self._before is not None

    def joining(self) -> None:
        with self._lock:
            self._before = {ino for ino, _ in _tcp_sockets()}
            self._world = set()

    def ready(self, keep_ports: Iterable[int]) -> int:
        """Record the world's connections: those opened since :meth:`joining`, except any to or
        from ``keep_ports`` (the rendezvous stores) and listeners (gloo's listener thread dies on
        an accept error, taking the process with it). Returns how many."""
        with self._lock:
            if self._before is None:
                return 0
            self._world = self._opened_since(self._before, keep_ports)
            self._before = None
            return len(self._world)

    @staticmethod
    def _opened_since(before: set[int], keep_ports: Iterable[int]) -> set[int]:
        keep = set(keep_ports) - {0}
        return {ino for ino, (local, remote) in _tcp_sockets()
                if ino not in before and remote and local not in keep and remote not in keep}

    def cut(self, keep_ports: Iterable[int] | None = None) -> int:
        """Shut down every recorded connection still open (both directions); forget them.
        Given ``keep_ports`` while the world's first step is still running (nothing recorded yet),
        the connections opened since :meth:`joining` less those are cut instead. Returns how many
        were cut."""
        with self._lock:
            world, before = self._world, self._before
            if before is not None and keep_ports is not None:
                world = self._opened_since(before, keep_ports)
            self._world, self._before = set(), None
            cut = 0
            for fd, ino in _socket_fds():
                if ino in world and _shut_down(fd, ino):
                    cut += 1
        if cut:
            log.info("cut %d connection(s) of the old world", cut)
        return cut

    def cut_join(self, hosted_ports: Iterable[int]) -> int:
        """Break a join that cannot finish: shut down the connections opened since
        :meth:`joining`, this rank's store client among them, but not the server side of a
        store this process hosts (``hosted_ports``: other ranks, of later rounds too, use it) nor
        listeners. The blocked rendezvous then fails at once, here and on the peers connected to
        this rank. Returns how many were cut."""
        hosted = set(hosted_ports)
        with self._lock:
            before = self._before
            if before is None:
                return 0
            doomed = {ino for ino, (local, remote) in _tcp_sockets()
                      if ino not in before and remote and local not in hosted}
            return sum(1 for fd, ino in _socket_fds() if ino in doomed and _shut_down(fd, ino))


def _shut_down(fd: int, ino: int) -> bool:
    """Shut socket ``fd`` down both ways if it is still socket ``ino``; whether it was."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    with socket.socket(fileno=dup) as sock:
        if os.fstat(dup).st_ino != ino:
            return False  # the descriptor was reused meanwhile
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False  # already shut down


def _socket_fds() -> Iterator[tuple[int, int]]:
    """(descriptor, inode) of this process's sockets."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            yield int(name), int(target[8:-1])


def _tcp_sockets() -> Iterator[tuple[int, tuple[int, int]]]:
    """(inode, (local port, remote port)) of this process's TCP sockets; remote 0 for a listener."""
    for fd, ino in _socket_fds():
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        with socket.socket(fileno=dup) as sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                local = int(sock.getsockname()[1])
            except OSError:
                continue
            try:
                remote = int(sock.getpeername()[1])
            except OSError:
                remote = 0
            yield ino, (local, remote)


world_sockets = WorldSockets()
"""This process's one world at a time."""
