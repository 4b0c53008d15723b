"""systemd notifications for the agent command, through the daemon's ``SystemdNotifier``.

``Type=notify`` units wait for ``READY=1``; with ``WatchdogSec=`` set, systemd restarts the
service unless ``WATCHDOG=1`` arrives more often than that. Outside systemd nothing is sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from stalwart.daemon.observe import SystemdNotifier

_notifier = SystemdNotifier()


def notify(*fields: str) -> bool:
    """Send ``KEY=VALUE`` fields in one datagram; False when not under systemd."""
    return _notifier.notify(*fields)


def watchdog_interval() -> float | None:
    """How often to ping (half of ``WatchdogSec=``), or None without a watchdog."""
    return _notifier.watchdog_interval


def start_watchdog(healthy: Callable[[], bool], stop: threading.Event) -> threading.Thread | None:
    """Ping the watchdog while ``healthy()`` holds; a stuck or unhealthy service stops pinging."""
    interval = _notifier.watchdog_interval
    if interval is None:
        return None

    def loop() -> None:
        while not stop.wait(interval):
            if healthy():
                notify("WATCHDOG=1")

    thread = threading.Thread(target=loop, daemon=True, name="sd-watchdog")
    thread.start()
    return thread
