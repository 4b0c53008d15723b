"""Helpers shared by tests (importable as ``testkit``: pytest puts tests/ on the path)."""

from __future__ import annotations

import subprocess
import sys


def python_child(code: str, *args: str) -> subprocess.Popen[str]:
    """Run ``code`` in a fresh interpreter (a real separate process), line-buffered output."""
    return subprocess.Popen(
        [sys.executable, "-u", "-c", code, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
