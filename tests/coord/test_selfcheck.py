"""The demo's coordination self-check passes end to end on a real 3-member etcd."""

from __future__ import annotations

from stalwart.coord.selfcheck import run_selfcheck


def test_selfcheck_passes_every_check() -> None:
    lines: list[str] = []
    report = run_selfcheck(nodes=3, ttl=2, progress=lines.append)
    assert [c.name for c in report.checks] == [
        "register nodes", "elect leader", "silent node detected",
        "etcd member killed under load", "leader crash and fencing",
    ]
    failed = [c for c in report.checks if not c.passed]
    assert not failed, report.table()
    assert report.passed
