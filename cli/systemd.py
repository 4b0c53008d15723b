"""systemd's notify protocol, by hand: one datagram to ``$NOTIFY_SOCKET`` per message.

``Type=notify`` units wait for ``READY=1``; with ``WatchdogSec=`` set, systemd passes
``WATCHDOG_USEC`` and restarts the service unless ``WATCHDOG=1`` arrives more often than that.
Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable


def notify(message: str) -> bool:
    """Send one notification; True if it was sent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(path)
        sock.sendall(message.encode())
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog timeout systemd asked for, in seconds (None when there is none)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


def start_watchdog(healthy: Callable[[], bool], stop: threading.Event) -> threading.Thread | None:
    """Ping the watchdog while ``healthy()`` holds; a stuck or unhealthy service stops pinging."""
    interval = watchdog_interval()
    if interval is None:
        return None

    def loop() -> None:
        while not stop.wait(interval):
            if healthy():
                notify("WATCHDOG=1")

    thread = threading.Thread(target=loop, daemon=True, name="sd-watchdog")
    thread.start()
    return thread
