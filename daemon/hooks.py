"""Telling the scheduler about a quarantine: the daemon's ``on_quarantine`` command.

A node that stalwart quarantines stays out of its rounds, but a scheduler that does not know
would hand it to the next job. The leader therefore runs one operator-given command per new
quarantine, for example::

    on_quarantine = ["scontrol", "update", "nodename={node}", "state=drain", "reason={reason}"]
    on_quarantine = ["kubectl", "cordon", "{node}"]

``{node}``, ``{job}`` and ``{reason}`` are replaced in every argument (no shell is involved, so a
reason cannot inject anything); the same values are in the environment as ``STALWART_NODE``,
``STALWART_JOB`` and ``STALWART_REASON`` for a script. Commands run one at a time on a thread of
their own, each bounded by ``hook_timeout``, so a slow scheduler never delays a round decision. A
failure is logged and counted, never retried: the quarantine itself is in etcd either way, and
``stalwart status`` shows it.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["QuarantineHook", "expand"]

log = logging.getLogger(__name__)

_OUTPUT_SHOWN = 500  # characters of a failed command's output in the log line


def expand(argv: Sequence[str], node: str, job: str, reason: str) -> list[str]:
    """``argv`` with ``{node}``, ``{job}`` and ``{reason}`` replaced (other braces kept as they are)."""
    out = []
    for arg in argv:
        for name, value in (("{node}", node), ("{job}", job), ("{reason}", reason)):
            arg = arg.replace(name, value)
        out.append(arg)
    return out


class QuarantineHook:
    """Runs ``argv`` once per quarantined node, in the background (see the module docstring).

    ``on_done(outcome)`` is called with ``"ok"``, ``"failed"`` or ``"timeout"`` after each run
    (the daemon counts them in a metric). :meth:`close` waits for the command running now.
    """

    def __init__(self, argv: Sequence[str], job: str, timeout: float,
                 on_done: Callable[[str], None] = lambda outcome: None) -> None:
        self.argv, self.job, self.timeout, self._on_done = tuple(argv), job, timeout, on_done
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="on-quarantine") if argv else None

    @property
    def enabled(self) -> bool:
        return self._pool is not None

    def quarantined(self, node: str, reason: str) -> Future[str] | None:
        """Start the command for ``node`` (None when no command is configured)."""
        if self._pool is None:
            return None
        return self._pool.submit(self._run, node, reason)

    def _run(self, node: str, reason: str) -> str:
        argv = expand(self.argv, node, self.job, reason)
        env = {**os.environ, "STALWART_NODE": node, "STALWART_JOB": self.job, "STALWART_REASON": reason}
        ctx = {"node": node}
        try:
            done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            log.error("node %s: on_quarantine command %s ran past %gs and was killed", node, argv[0], self.timeout,
                      extra=ctx)
            outcome = "timeout"
        except OSError as exc:
            log.error("node %s: on_quarantine command %s could not start: %s", node, argv[0], exc, extra=ctx)
            outcome = "failed"
        else:
            if done.returncode == 0:
                log.warning("node %s: quarantine handed to the scheduler: %s", node, " ".join(argv), extra=ctx)
                outcome = "ok"
            else:
                shown = (done.stderr or done.stdout).strip()[:_OUTPUT_SHOWN]
                log.error("node %s: on_quarantine command %s exited %d: %s", node, argv[0], done.returncode,
                          shown or "(no output)", extra=ctx)
                outcome = "failed"
        self._on_done(outcome)
        return outcome

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
