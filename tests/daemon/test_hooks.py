"""The on_quarantine command: placeholders without a shell, outcomes counted, a slow one killed."""

from __future__ import annotations

import sys
from pathlib import Path

from stalwart.daemon.hooks import QuarantineHook, expand


def test_placeholders_are_replaced_in_each_argument_and_nothing_is_interpreted() -> None:
    argv = expand(["scontrol", "update", "nodename={node}", "reason={reason}", "{x}"], "n1", "j", "a; rm -rf /")
    assert argv == ["scontrol", "update", "nodename=n1", "reason=a; rm -rf /", "{x}"]


def test_outcomes_ok_failed_timeout_and_a_missing_program(tmp_path: Path) -> None:
    seen: list[str] = []
    ok = QuarantineHook([sys.executable, "-c", "import os, sys; assert os.environ['STALWART_NODE'] == sys.argv[1]",
                         "{node}"], "j", 30, seen.append)
    failed = QuarantineHook([sys.executable, "-c", "raise SystemExit(3)"], "j", 30, seen.append)
    slow = QuarantineHook([sys.executable, "-c", "import time; time.sleep(60)"], "j", 0.5, seen.append)
    missing = QuarantineHook([str(tmp_path / "no-such-program")], "j", 30, seen.append)
    for hook in (ok, failed, slow, missing):
        future = hook.quarantined("n7", "why")
        assert future is not None
        future.result(timeout=60)
        hook.close()
    assert seen == ["ok", "failed", "timeout", "failed"]
    assert QuarantineHook((), "j", 30).quarantined("n7", "why") is None
