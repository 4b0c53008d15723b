"""Months in minutes (``bench/months_bench.py``): a clock-compressed run of a job's control traffic,
checkpoints and faults against a real etcd and daemon keeps etcd's keys, database, the daemon's
memory and fds, its log and the checkpoint storage bounded. The short form runs by default; the
long form (1,000 nodes, 90 simulated days) is marked slow."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "months_bench.py"


def _bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("months_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["months_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_run_prunes_compacts_rotates_and_keeps_retention(tmp_path: Path) -> None:
    bench = _bench()
    cfg = bench.Config(nodes=20, days=4, ckpts_per_day=16, faults_per_day=4, keep_ckpt_records=10,
                       compact_interval=1.0, log_max_bytes=20_000, log_backups=2, quiet=True)
    report = bench.run(cfg, tmp_path)
    last = report.samples[-1]
    assert report.checkpoints >= 64 and report.faults == 16  # a few more when a regrow waits for a commit
    assert report.rounds >= 2 * report.faults  # the first, a shrink for each fault, a regrow for each but the last
    assert last.ckpt_records == cfg.keep_ckpt_records  # older commit records pruned
    assert last.ckpt_dirs <= cfg.keep_last + 1  # storage under the retention policy
    assert 0 < last.compacted_revision < last.revision  # history compacted
    assert 1 < last.log_files <= cfg.log_backups + 1  # the log rotated, old files dropped
    assert last.log_bytes <= (cfg.log_backups + 1) * cfg.log_max_bytes
    assert report.verdicts == dict.fromkeys(report.verdicts, True), report.verdicts
    bench.plot(report, tmp_path / "months.png")
    assert (tmp_path / "months.png").stat().st_size > 0


@pytest.mark.slow
def test_ninety_days_of_a_thousand_nodes_stay_bounded(tmp_path: Path) -> None:
    bench = _bench()
    report = bench.run(bench.Config(quiet=True), tmp_path)
    assert report.samples[-1].day >= 90
    assert report.checkpoints >= 90 * 48 and report.rounds >= 1000
    assert report.verdicts == dict.fromkeys(report.verdicts, True), report.verdicts
