"""Helpers shared by tests (importable as ``testkit``: pytest puts tests/ on the path)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def python_child(code: str, *args: str) -> subprocess.Popen[str]:
    """Run ``code`` in a fresh interpreter (a real separate process), line-buffered output."""
    return subprocess.Popen(
        [sys.executable, "-u", "-c", code, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: its parent has not reaped it yet).

    The check and the status read race with the reaper, so a process that vanishes between them
    counts as gone rather than raising.
    """
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(pred: Callable[[], T], timeout: float, what: str, logs: Path | None = None, *,
             interval: float = 0.02, retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``pred`` until it returns something true, and return that.

    After ``timeout`` seconds raise AssertionError naming ``what``, with the last lines of each
    ``*.log`` in the folder ``logs`` when given. An exception of a ``retry_on`` type counts as
    "not yet".
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
            if value:
                return value
        except retry_on:
            pass
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    message = f"timed out after {timeout} s waiting for {what}"
    if logs is not None:
        message += "\n" + "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                                     for p in sorted(logs.glob("*.log")))
    raise AssertionError(message)


def torchrun(script: str, *script_args: str, nnodes: str, endpoint: str, job: str, node: str,
             backend: str = "stalwart", conf: str = "", extra_env: dict[str, str] | None = None,
             nproc: int = 1, log_file: str | None = None) -> subprocess.Popen[bytes]:
    """Start one torchrun (standing for one node) in its own process group."""
    import os

    conf_items = [c for c in (conf, f"node_id={node}" if backend == "stalwart" else "") if c]
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--max-restarts", "20", "--monitor-interval", "0.2", "--local-addr", "127.0.0.1",
            "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", job]
    if conf_items:
        args += ["--rdzv-conf", ",".join(conf_items)]
    env = dict(os.environ, STALWART_NODE=node, OMP_NUM_THREADS="1", **(extra_env or {}))
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen([*args, script, *script_args], stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """Wait for a process started in its own group to exit; its return code. A process still
    running after ``timeout`` has its whole group SIGKILLed (then TimeoutExpired is raised)."""
    import os
    import signal

    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a node losing power would.

    torchrun starts its workers in sessions of their own, so killing torchrun's process group
    alone leaves the workers running.
    """
    from stalwart.chaos.cluster import kill_tree as kill

    kill(pid)


def stalwart_in_process(*argv: str) -> subprocess.CompletedProcess[str]:
    """``stalwart ARGV...`` run by its ``main`` in this process, as a finished subprocess would
    report it: exit status, stdout and stderr (a usage error from argparse is exit status 2).

    Saves each CLI test a fresh interpreter that imports torch; the root logger ``main`` sets up
    is put back afterwards. A test or two per command still run the real ``stalwart`` command.
    """
    import contextlib
    import io
    import logging

    from stalwart.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse: --help, usage errors
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(["stalwart", *argv], code, out.getvalue(), err.getvalue())
