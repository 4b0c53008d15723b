"""Process priorities for work that must yield to training: warm spares, the preload process.

Stdlib only: the preload process (``agent/preload.py``) imports it before anything heavy.
"""

from __future__ import annotations

import os
import resource
import time

__all__ = ["can_restore_priority", "set_autogroup_nice"]


def set_autogroup_nice(pid: int, nice: int) -> None:
    """The nice value of the scheduler autogroup of ``pid``'s session (``/proc/<pid>/autogroup``).

    Why: with autogroups on (the default of most distributions) CPU time is first shared between
    sessions, and a process's own nice value counts only within its session. A spare runs in a
    session of its own, so niced alone it would still take a whole session's share beside each
    worker. A kernel without autogroups has no such file: nothing to do. Unprivileged writes are
    rate-limited (EAGAIN): tried again once."""
    path = f"/proc/{pid}/autogroup"
    for attempt in range(2):
        try:
            with open(path, "w") as f:
                f.write(str(nice))
            return
        except FileNotFoundError:
            return
        except BlockingIOError:
            if attempt:
                raise
            time.sleep(0.11)


def can_restore_priority() -> bool:
    """Whether this process may lower a nice value again (root, or ``RLIMIT_NICE`` ≥ 20), as
    :meth:`Worker.restore_priority` must for a spare started niced."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
