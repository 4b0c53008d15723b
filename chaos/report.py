"""The survival report of a chaos run: JSON for scripts, Markdown for people, a PNG timeline.

The timeline shows the training step and the world size over time, each injected fault (red),
its detection (orange) and the first step after it (green), so a reader sees at a glance how
long each fault cost.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One completed training step, as rank 0 saw it."""

    t: float  # seconds since the run started
    step: int
    world: int
    round: int = 0
    loss: float | None = None


@dataclass
class FaultRecord:
    kind: str
    target: str
    injected_at: float
    detected_at: float | None = None
    resumed_at: float | None = None
    detail: str = ""
    lost_s: float | None = None  # training time it cost: pauses it caused plus steps redone because of it
    redone_steps: int = 0

    @property
    def detection_s(self) -> float | None:
        return None if self.detected_at is None else self.detected_at - self.injected_at

    @property
    def recovery_s(self) -> float | None:
        return None if self.resumed_at is None else self.resumed_at - self.injected_at


@dataclass(frozen=True)
class RoundChange:
    t: float  # when the runner saw it
    number: int
    world_size: int
    reason: str
    decided_at: float | None = None  # when the daemon decided it (same clock as t)
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestoreSource:
    """Where one world's restore took its state from (bytes summed over its ranks)."""

    t: float
    step: int
    world_size: int
    own_memory_bytes: int  # each rank's own host copy of its part
    peer_memory_bytes: int  # buddy replicas: copies held for other ranks, or pulled from peers
    storage_bytes: int  # read from the checkpoint files
    point: str = "checkpoint"  # what was restored: a committed "checkpoint" or a "memory generation"


@dataclass
class RunReport:
    scenario: str
    wall_s: float
    target_steps: int
    samples: list[Sample] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    rounds: list[RoundChange] = field(default_factory=list)
    final_committed_step: int = -1
    lost_committed_steps: int = 0
    corrupt_loads: int = 0
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stragglers: list[str] = field(default_factory=list)  # nodes the daemon named stragglers during the run
    rollbacks: int = 0  # training-health rollbacks (NaN/inf, loss spikes)
    skipped_samples: int = 0  # samples those rollbacks skipped
    badput: dict[str, float] = field(default_factory=dict)  # seconds by cause (chaos/badput.py)
    normal_step_s: float = 0.0
    bands: list[tuple[str, float, float]] = field(default_factory=list)  # (cause, start, end) of lost time
    restores: list[RestoreSource] = field(default_factory=list)
    # Where the first world's start went (its rank 0's "startup" record): seconds by phase, the
    # first from the run's start to the worker process's (cluster up, first round, spawn).
    startup_phases: dict[str, float] = field(default_factory=dict)

    def account(self) -> None:
        """Charge the run's lost time to its faults and causes (``chaos/badput.py``)."""
        from stalwart.chaos.badput import account

        acc = account(self.samples, self.faults, self.rounds, self.wall_s, self.final_committed_step)
        for fault, lost, redone in zip(self.faults, acc.lost_by_fault, acc.redone_by_fault, strict=True):
            fault.lost_s, fault.redone_steps = round(lost, 3), redone
        self.badput = {cause: round(v, 3) for cause, v in acc.badput.items()}
        self.normal_step_s = acc.normal_step_s
        self.bands = acc.bands

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    @property
    def goodput(self) -> float:
        return goodput(self.samples, self.final_committed_step, self.wall_s)

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["passed"] = self.passed
        data["goodput"] = round(self.goodput, 4)
        for fault, raw in zip(self.faults, data["faults"], strict=True):
            raw["detection_s"] = fault.detection_s
            raw["recovery_s"] = fault.recovery_s
        return data


def goodput(samples: list[Sample], committed_step: int, wall_s: float) -> float:
    """Time spent on steps that stayed committed, over wall time.

    A step counts once, by its last execution (earlier executions were rolled back and redone),
    and only if it is at or below the last committed step. Its time is the gap to the previous
    step of the same round; the first step of a round gets the run's median step time, since
    the gap before it is recovery, not training.
    """
    if wall_s <= 0 or not samples:
        return 0.0
    gaps: dict[int, float] = {}
    durations = []
    ordered = sorted(samples, key=lambda s: s.t)
    for prev, cur in zip(ordered, ordered[1:], strict=False):
        if cur.round == prev.round and cur.step == prev.step + 1:
            durations.append(cur.t - prev.t)
    typical = statistics.median(durations) if durations else 0.0
    last_of_step: dict[int, int] = {}
    for i, s in enumerate(ordered):
        last_of_step[s.step] = i
    for step, i in last_of_step.items():
        if step > committed_step:
            continue
        cur = ordered[i]
        prev = ordered[i - 1] if i > 0 else None
        same_round = prev is not None and prev.round == cur.round and prev.step == cur.step - 1
        gaps[step] = (cur.t - prev.t) if same_round and prev is not None else typical
    return min(1.0, sum(gaps.values()) / wall_s)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(report: RunReport, picture: str | None) -> str:
    lines = [f"# Chaos run: {report.scenario}", "",
             f"**Result: {'PASSED' if report.passed else 'FAILED'}** — wall time {report.wall_s:.1f} s, "
             f"last committed step {report.final_committed_step} of {report.target_steps}, "
             f"goodput {report.goodput:.1%}, lost committed steps {report.lost_committed_steps}, "
             f"corrupt loads {report.corrupt_loads}.", ""]
    if report.rollbacks or report.stragglers:
        lines += [f"Training health: {report.rollbacks} rollbacks skipping {report.skipped_samples} samples; "
                  f"stragglers: {', '.join(report.stragglers) or 'none'}.", ""]
    if picture:
        lines += [f"![timeline]({picture})", ""]
    lines += ["| fault | target | injected at s | detected after s | resumed after s | lost s | steps redone "
              "| detail |", "|---|---|---|---|---|---|---|---|"]
    for f in report.faults:
        lines.append(f"| {f.kind} | {f.target} | {f.injected_at:.2f} | {_fmt(f.detection_s)} | "
                     f"{_fmt(f.recovery_s)} | {_fmt(f.lost_s)} | {f.redone_steps} | {f.detail} |")
    if report.badput:
        lines += ["", f"Where the {report.wall_s:.1f} s went (normal step {report.normal_step_s:.3f} s; "
                      "a fault's lost time is split into detection, decision, re-form and restore, "
                      "stall and recomputation):", "", "| | seconds | share |", "|---|---|---|"]
        train = report.wall_s - sum(report.badput.values())
        for cause, v in [("training", train), *report.badput.items()]:
            if v > 0 or cause == "training":
                lines.append(f"| {cause} | {v:.2f} | {v / report.wall_s:.1%} |")
    if report.startup_phases:
        lines += ["", "Startup, to the first world's first step (its rank 0): " + ", ".join(
            f"{name} {v:.2f} s" for name, v in report.startup_phases.items()) + "."]
    lines += ["", "| round | at s | world size | reason |", "|---|---|---|---|"]
    lines += [f"| {r.number} | {r.t:.2f} | {r.world_size} | {r.reason} |" for r in report.rounds]
    if report.restores:
        lines += ["", "Restores, by source (bytes over the world's ranks):", "",
                  "| at s | step | restore point | world size | own memory | peer memory | storage |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.t:.2f} | {r.step} | {r.point} | {r.world_size} | {r.own_memory_bytes:,} | "
                  f"{r.peer_memory_bytes:,} | {r.storage_bytes:,} |" for r in report.restores]
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {name} | {'ok' if ok else 'FAILED'} |" for name, ok in report.checks.items()]
    if report.notes:
        lines += ["", *[f"- {n}" for n in report.notes]]
    return "\n".join(lines) + "\n"


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message says which extra brings it."""


def plot(report: RunReport, path: Path) -> None:
    """The timeline picture; needs matplotlib (the optional ``stalwart[chaos]``)."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("the timeline picture needs matplotlib: pip install 'stalwart[chaos]'") from None

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_world) = plt.subplots(2, 1, sharex=True, figsize=(11, 6),
                                            gridspec_kw={"height_ratios": [3, 1]})
    ts = [s.t for s in report.samples]
    ax_step.plot(ts, [s.step for s in report.samples], ".", markersize=2, color="tab:blue", label="step (rank 0)")
    ax_step.set_ylabel("training step")
    ax_step.yaxis.get_major_locator().set_params(integer=True)
    if report.rounds:
        xs = [r.t for r in report.rounds] + [report.wall_s]
        ys = [r.world_size for r in report.rounds] + [report.rounds[-1].world_size]
        ax_world.step(xs, ys, where="post", color="tab:purple")
    ax_world.set_ylabel("world size")
    ax_world.set_xlabel("seconds since start")
    ax_world.yaxis.get_major_locator().set_params(integer=True)
    colours = {"startup": "tab:gray", "detection": "tab:orange", "decision": "gold", "re-form and restore": "tab:cyan",
               "stall": "tab:pink", "other": "tab:brown"}
    for cause, start, end in report.bands:
        ax_step.axvspan(start, end, color=colours.get(cause, "tab:olive"), alpha=0.25, linewidth=0)
    for f in report.faults:
        for ax in (ax_step, ax_world):
            ax.axvline(f.injected_at, color="tab:red", alpha=0.7, linewidth=1)
            if f.detected_at is not None:
                ax.axvline(f.detected_at, color="tab:orange", alpha=0.7, linewidth=1, linestyle="--")
            if f.resumed_at is not None:
                ax.axvline(f.resumed_at, color="tab:green", alpha=0.7, linewidth=1, linestyle=":")
        ax_step.annotate(f.kind, (f.injected_at, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         fontsize=7, va="top", ha="right", color="tab:red")
    handles = [plt.Line2D([], [], color=c, linestyle=ls, label=lab) for c, ls, lab in (
        ("tab:red", "-", "fault injected"), ("tab:orange", "--", "detected"), ("tab:green", ":", "first resumed step"))]
    import matplotlib.patches as mpatches

    shown = {cause for cause, _, _ in report.bands}
    handles += [mpatches.Patch(color=c, alpha=0.25, label=f"lost: {cause}") for cause, c in colours.items()
                if cause in shown]
    ax_step.legend(handles=[*ax_step.get_legend_handles_labels()[0], *handles], loc="lower right", fontsize=7)
    ax_step.set_title(f"{report.scenario}: {'passed' if report.passed else 'FAILED'}, "
                      f"goodput {report.goodput:.0%}, {len(report.faults)} faults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: RunReport, out_dir: Path) -> dict[str, Path]:
    """Write ``report.json``, ``report.md`` and ``timeline.png`` into ``out_dir``; without
    matplotlib the picture is left out (with a warning) and ``paths`` has no ``"picture"``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "markdown": out_dir / "report.md", "picture": out_dir / "timeline.png"}
    try:
        plot(report, paths["picture"])
    except MissingExtra as exc:
        log.warning("%s; writing the report without it", exc)
        del paths["picture"]
    paths["json"].write_text(json.dumps(report.to_json(), indent=2))
    paths["markdown"].write_text(markdown(report, paths["picture"].name if "picture" in paths else ""))
    return paths
