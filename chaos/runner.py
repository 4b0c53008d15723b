"""``stalwart chaos run``: bring a cluster up, train, inject the scenario's faults, check, report.

The runner only observes from outside, as an operator would: the round key in etcd, the leader
key, the agents' gRPC status, and the trainer's step record (rank 0 writes one JSON line per
step, restore and commit). From those it times each fault's detection and the first step after
it, and checks what must hold after any fault: the job reaches its last step, every sample is
used exactly once in committed progress, the losses match a fault-free run, and no checkpoint
that was corrupted on purpose was ever loaded.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from stalwart.chaos.cluster import LocalCluster
from stalwart.chaos.netns import unavailable_reason
from stalwart.chaos.report import FaultRecord, RestoreSource, RoundChange, RunReport, Sample
from stalwart.chaos.scenario import FaultSpec, Scenario
from stalwart.proto import agent_pb2

log = logging.getLogger(__name__)
LOSS_RTOL = 1e-4  # a different world size sums the same samples in another order
TRAINING_FAULTS = ("nan-loss", "loss-spike")
# faults applied to a running worker of their node (corrupt-checkpoint kills one to force a restore)
WORKER_FAULTS = ("kill-worker", "hang-worker", "slow-worker", "corrupt-checkpoint", *TRAINING_FAULTS)
TRAINING_FAULT_LEAD = 6  # steps before its at_step that a NaN or a spike is sent to the agent
TRAINING_FAULT_AHEAD = 3  # it never names a step closer than this to the last step seen
GAVE_UP_WAIT_S = 20.0  # after the trainer gave up, how long the run waits for the daemon to close the job
APPLY_RETRY_S = 10.0  # a fault that cannot be applied is tried again (once a second) this long
AGENT_FAULTS = ("kill-agent", "restart-agent")  # the agent only: its workers train on
RECOVER_AFTER = 4.0  # seconds until a killed daemon or etcd member is started again
AGENT_RESTART_AFTER = 1.0  # a crashed agent is started again as its unit's RestartSec=1 would
UNDO_TRIES, UNDO_RETRY_S = 5, 1.0  # a fault whose undo fails (its target unreachable) is undone again
UNDO_CALL_S = 2.0  # the deadline of an undo's call to an agent: the runner waits on it
AGENT_HANDOFF_AFTER = 0.2  # `systemctl restart`: the next agent starts as soon as the old one exited


def fault_target(spec: FaultSpec, members: list[str], cut: set[str]) -> str:
    """The node a fault aimed at ``spec.node`` goes to. A fault on a worker needs one: a node out
    of the world just now (warming a spare) has none, and one whose link is ``cut`` cannot be
    told (the call would hold the runner, and every undo due meanwhile, until its deadline), so
    such a fault goes to the first member that can be reached instead."""
    assert spec.node is not None
    reachable = sorted(m for m in members if m not in cut)
    if spec.kind in WORKER_FAULTS and reachable and spec.node not in reachable:
        return reachable[0]
    return spec.node


@dataclass
class _Active:
    spec: FaultSpec
    record: FaultRecord
    round_before: int
    leader_before: tuple[str, float] | None
    undo_at: float | None = None
    undo: Callable[[], None] | None = None
    undone_at: float | None = None
    moot: bool = False  # the fault changed nothing the system could see (no save while the disk was full)
    at_step: int | None = None  # nan-loss, loss-spike: the step whose loss it replaces
    undo_tries: int = 0


class Runner:
    def __init__(self, scenario: Scenario, workdir: Path, *, progress: Callable[[str], None] = print,
                 timeout: float = 600.0, reference: bool = True) -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.progress = progress
        self.timeout = timeout
        self.reference = reference
        self.rng = random.Random(scenario.seed)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> RunReport:
        ref_losses: dict[int, float] = {}
        if self.reference:
            self.progress("reference run without faults ...")
            ref = _Run(_reference_of(self.scenario), self.workdir / "reference", self.rng,
                       lambda line: None, self.timeout).execute()
            ref_losses = ref.losses
            self.progress(f"reference: {len(ref_losses)} steps in {ref.report.wall_s:.1f} s")
        run = _Run(self.scenario, self.workdir / "run", self.rng, self.progress, self.timeout)
        result = run.execute()
        report = result.report
        if self.reference:
            report.checks["losses match the fault-free run"] = _losses_match(result.losses, ref_losses, report)
        return report


@dataclass
class _Result:
    report: RunReport
    losses: dict[int, float]


class _Run:
    def __init__(self, scenario: Scenario, workdir: Path, rng: random.Random, progress: Callable[[str], None],
                 timeout: float) -> None:
        self.s = scenario
        self.workdir = workdir
        self.rng = rng
        self.progress = progress
        self.timeout = timeout
        shutil.rmtree(workdir, ignore_errors=True)
        self.cluster = LocalCluster(scenario, workdir)
        self.t0 = 0.0
        self.events: list[dict[str, object]] = []
        self._offset = 0
        self.rounds: list[RoundChange] = []
        self.faults: list[_Active] = []
        self.corrupted: dict[int, float] = {}  # checkpoint step -> when its byte was flipped
        self.notes: list[str] = []
        self.straggler_seen: set[str] = set()
        self._first_failure: dict[int, float] = {}  # id(FaultSpec) -> when applying it first failed
        self._retry_at: dict[int, float] = {}
        self._corrupted_for: dict[int, int] = {}  # id(FaultSpec) -> the checkpoint step it corrupted

    def now(self) -> float:
        return time.time() - self.t0

    def execute(self) -> _Result:
        pending = sorted([*self.s.faults, *self.s.random_faults()],
                         key=lambda f: (f.at_step if f.at_step is not None else math.inf, f.at_time or 0.0))
        self.t0 = time.time()
        try:
            self.cluster.start()
            last_line = 0.0
            gave_up_at = 0.0
            while self.now() < self.timeout:
                self._read_record()
                self._watch_round()
                step = self._last_step()
                for spec in [f for f in pending if self._due(f, step) and self.now() >= self._retry_at.get(id(f), 0.0)]:
                    if self._inject(spec):
                        pending.remove(spec)
                self._follow_faults()
                if self.now() - last_line >= 1.0:
                    last_line = self.now()
                    self.progress(self._status_line(step))
                if self._finished() and pending:
                    self.notes.append(f"{len(pending)} faults of the timeline not injected: the job finished first")
                    pending.clear()
                if self._finished() and all(a.undo is None for a in self.faults):
                    break
                gave_up = next((e for e in self.events if e.get("event") == "gave_up"), None)
                if gave_up is not None:  # exit status 3: the daemon closes the job, nothing restarts it
                    gave_up_at = gave_up_at or self.now()
                    closed = bool(self.rounds) and self.rounds[-1].world_size == 0
                    if closed or self.now() - gave_up_at > GAVE_UP_WAIT_S:
                        late = "" if closed else f"; the daemon did not close it in {GAVE_UP_WAIT_S:g} s"
                        why = f"step {gave_up.get('step')}: {gave_up.get('reason')}{late}"
                        self.notes.append(f"the job gave up at {why}")
                        break  # the cluster's teardown undoes what faults are still in place
                time.sleep(0.1)
            else:
                self.notes.append(f"timed out after {self.timeout:g} s")
        finally:
            self.cluster.stop()
        return self._result()

    # -- observing -------------------------------------------------------------------------------

    def _read_record(self) -> None:
        path = self.cluster.steps_log
        if not path.exists():
            return
        with open(path) as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        for line in complete.splitlines():
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                continue

    def _steps(self) -> list[dict[str, object]]:
        return [e for e in self.events if e.get("event") == "step"]

    def _last_step(self) -> int:
        steps = self._steps()
        return int(steps[-1]["step"]) if steps else 0  # type: ignore[call-overload]

    def _finished(self) -> bool:
        return any(e.get("event") == "commit" and e.get("step") == self.s.job.steps for e in self.events)

    def _watch_round(self) -> None:
        try:
            rnd = self.cluster.round()
        except Exception:  # etcd between members: next time
            return
        if rnd is None:
            return
        world = 0 if rnd.closed else len(rnd.members)
        if not self.rounds or (self.rounds[-1].number, self.rounds[-1].world_size) != (rnd.number, world):
            decided = rnd.decided_at - self.t0 if rnd.decided_at else None
            members = () if rnd.closed else tuple(m.node_id for m in rnd.members)
            self.rounds.append(RoundChange(self.now(), int(rnd.number), world, rnd.reason, decided, members))
            self.progress(f"  round {rnd.number}: {world} nodes ({rnd.reason})")

    def _status_line(self, step: int) -> str:
        r = self.rounds[-1] if self.rounds else None
        nodes = []
        for node, proc in self.cluster.agents.items():
            nodes.append(f"{node}:{'in' if r and node in self.cluster.members() else 'out'}"
                         f"{'' if proc.alive else '(down)'}")
        head = f"[{self.now():6.1f}s] round {r.number if r else '-'} world {r.world_size if r else 0}"
        return f"{head} step {step}/{self.s.job.steps} | {' '.join(nodes)}"

    # -- faults ----------------------------------------------------------------------------------

    def _due(self, spec: FaultSpec, step: int) -> bool:
        if spec.at_step is not None:
            # A NaN or a spike is sent ahead, so that the trainer has it before step at_step runs.
            lead = TRAINING_FAULT_LEAD if spec.kind in TRAINING_FAULTS else 0
            due = step >= spec.at_step - lead
        else:
            due = self.now() >= (spec.at_time or 0.0)
        if due and spec.during == "regrow":
            # while a regrow's re-form is in flight: a regrow round seen just now
            last = self.rounds[-1] if self.rounds else None
            return last is not None and last.reason.startswith("regrow") and self.now() - last.t < 0.5
        return due

    def _target(self, spec: FaultSpec) -> str:
        members = self.cluster.members()
        if spec.node is not None:
            return fault_target(spec, members, {m for m in members if self._cut_off(m, None)})
        return self.rng.choice(members or self.s.node_names())

    def _inject(self, spec: FaultSpec) -> bool:
        """Apply ``spec``; False when it failed and is to be tried again (for up to APPLY_RETRY_S:
        e.g. the target's agent is restarting, or retention is replacing the newest checkpoint)."""
        rnd = self.rounds[-1].number if self.rounds else 0
        target = self._target(spec)
        active = _Active(spec, FaultRecord(spec.kind, target, self.now()), rnd, self.cluster.leader_term())
        try:
            detail = self._apply(active, target)
        except Exception as exc:  # the fault could not be applied: try again, then say so in the report
            first = self._first_failure.setdefault(id(spec), self.now())
            if self.now() - first < APPLY_RETRY_S:
                self._retry_at[id(spec)] = self.now() + 1.0
                self.progress(f"! {spec.kind} on {target} failed ({exc}); trying again")
                return False
            detail = f"not applied: {exc}"
            active.record.detail = detail
            self.notes.append(f"{spec.kind} on {target} at {active.record.injected_at:.1f} s: {detail}")
            active.record.detected_at = active.record.resumed_at = None
            self.progress(f"! {spec.kind} on {target}: {detail}")
            return True
        active.record.detail = detail
        self.faults.append(active)
        self.progress(f"! injected {spec.kind} on {target}: {detail}")
        return True

    def _apply(self, a: _Active, target: str) -> str:
        kind, c = a.spec.kind, self.cluster
        if kind in (*WORKER_FAULTS, "gpu-fault") and self._cut_off(target, None):
            raise RuntimeError(f"the link of {target} is cut: its agent cannot be told")  # tried again shortly
        if kind in ("kill-worker", "hang-worker"):
            fault = agent_pb2.FAULT_KILL_WORKER if kind == "kill-worker" else agent_pb2.FAULT_HANG_WORKER
            reply = c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(kind=fault, device=a.spec.rank))
            return reply.detail  # type: ignore[attr-defined, no-any-return]
        if kind == "gpu-fault":
            reply = c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(
                kind=agent_pb2.FAULT_GPU_XID, device=a.spec.rank, code=a.spec.code))
            a.undo_at = a.record.injected_at + RECOVER_AFTER + 4
            a.undo = lambda: c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(kind=agent_pb2.FAULT_CLEAR),
                                          timeout=UNDO_CALL_S)
            return reply.detail  # type: ignore[attr-defined, no-any-return]
        if kind == "kill-agent":
            c.kill_agent(target)
            a.undo_at, a.undo = a.record.injected_at + AGENT_RESTART_AFTER, lambda: c.start_agent(target)
            return f"agent SIGKILLed (its workers train on); restarted after {AGENT_RESTART_AFTER:g} s"
        if kind == "kill-node":
            killed = c.kill_node(target)
            a.undo_at, a.undo = a.record.injected_at + a.spec.duration, lambda: c.start_agent(target)
            return f"node lost: its agent and {killed} worker process(es) SIGKILLed; back after {a.spec.duration:g} s"
        if kind == "restart-agent":
            c.restart_agent_handoff(target)
            a.undo_at, a.undo = a.record.injected_at + AGENT_HANDOFF_AFTER, lambda: c.start_agent(target)
            return "agent restarted the systemd way (SIGUSR1: hand-off; its workers train on)"
        if kind == "kill-daemon":
            leader = c.leader()
            if leader is None:
                raise RuntimeError("no daemon leads")
            c.kill_daemon(leader)
            a.record.target = leader
            a.undo_at, a.undo = a.record.injected_at + RECOVER_AFTER, lambda: c.start_daemon(leader)
            return f"leader {leader} SIGKILLed; restarted later as a standby"
        if kind == "kill-etcd":
            index = self.rng.randrange(len(c.etcd.members))
            c.etcd.kill(index)
            a.record.target = c.etcd.members[index].name
            a.undo_at, a.undo = a.record.injected_at + RECOVER_AFTER, lambda: c.etcd.restart(index)
            return f"etcd member {a.record.target} SIGKILLed; restarted later"
        if kind == "lose-quorum":
            members = c.etcd.members
            majority = [i for i in range(len(members))][: len(members) // 2 + 1]
            for index in majority:
                c.etcd.kill(index)
            a.record.target = ",".join(members[i].name for i in majority)
            duration = a.spec.duration

            def restore() -> None:
                for index in majority:
                    c.etcd.restart(index)

            a.undo_at, a.undo = a.record.injected_at + duration, restore
            return f"etcd members {a.record.target} SIGKILLed: no quorum for {duration:g} s"
        if kind == "corrupt-checkpoint":
            # A retry (the kill below failed) kills again without flipping another checkpoint.
            step = self._corrupted_for.get(id(a.spec)) or self._corrupt_newest()
            self._corrupted_for[id(a.spec)] = step
            # Corruption shows only when a checkpoint is loaded: force a restore by killing a worker.
            c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(kind=agent_pb2.FAULT_KILL_WORKER, device=0))
            return f"flipped a byte in checkpoint {step}, then killed a worker to force a restore"
        if kind in TRAINING_FAULTS:
            # The scenario's step, or (timed, or already past) one far enough ahead that the
            # command reaches the trainer before that step runs.
            step = max(a.spec.at_step or 0, self._last_step() + TRAINING_FAULT_AHEAD)
            a.at_step = step
            factor = a.spec.factor or 1000.0
            fault = agent_pb2.FAULT_NAN_LOSS if kind == "nan-loss" else agent_pb2.FAULT_LOSS_SPIKE
            reply = c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(
                kind=fault, device=a.spec.rank, step=step, factor=factor))
            if not reply.applied:  # type: ignore[attr-defined]
                raise RuntimeError(reply.detail)  # type: ignore[attr-defined]
            return f"step {step}: {reply.detail}"  # type: ignore[attr-defined]
        if kind == "slow-worker":
            factor = a.spec.factor or 2.0
            reply = c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(
                kind=agent_pb2.FAULT_SLOW_WORKER, device=a.spec.rank, factor=factor))
            if not reply.applied:  # type: ignore[attr-defined]
                raise RuntimeError(reply.detail)  # type: ignore[attr-defined]
            a.undo_at = a.record.injected_at + a.spec.duration
            a.undo = lambda: c.agent_call(target, "InjectFault", agent_pb2.FaultRequest(kind=agent_pb2.FAULT_CLEAR),
                                          timeout=UNDO_CALL_S)
            return f"{reply.detail} for {a.spec.duration:g} s"  # type: ignore[attr-defined]
        if kind == "network-cut":
            net = c.net
            if net is None:
                raise RuntimeError(unavailable_reason() or "this cluster runs without network namespaces")
            net.cut(target)
            a.undo_at, a.undo = a.record.injected_at + a.spec.duration, lambda: net.restore(target)
            return f"link of {target} ({net.address(target)}) down for {a.spec.duration:g} s"
        if kind == "fill-disk":
            taken = c.fill_disk()
            a.undo_at, a.undo = a.record.injected_at + a.spec.duration, c.free_disk
            return f"checkpoint file system filled ({taken >> 20} MiB); freed after {a.spec.duration:g} s"
        raise RuntimeError(f"no injector for {kind}")

    def _corrupt_newest(self) -> int:
        root = self.cluster.ckpt_dir
        committed = sorted(d for d in root.glob("step-*") if (d / "manifest.json").exists()
                           and int(d.name.split("-")[-1]) not in self.corrupted)  # a second flip would undo the first
        if not committed:
            raise RuntimeError("no committed checkpoint that is not corrupted already")
        from stalwart.ckpt import CheckpointError, read_manifest  # the manifest's format is ckpt's

        errors: list[str] = []
        for newest in reversed(committed):  # the newest may be going away under retention
            step = int(newest.name.split("-")[-1])
            try:
                manifest = read_manifest(str(root), step)
                break
            except CheckpointError as exc:
                errors.append(f"step {step}: {exc}")
        else:
            raise RuntimeError(f"no readable committed checkpoint to corrupt ({'; '.join(errors)})")
        # One byte in the middle of every stored chunk: whatever part of this step a restore
        # reads from disk is corrupt, so a restore that read any of it and did not refuse the
        # step loaded corrupt data. (Parts a re-forming survivor copies from its own memory
        # were never corrupted.)
        flips: dict[str, set[int]] = {}
        for tensor in manifest.tensors.values():
            for part in tensor.parts:
                for chunk in part.chunks:
                    flips.setdefault(part.file, set()).add(chunk.offset + chunk.stored // 2)
        for name, offsets in flips.items():
            with open(newest / name, "r+b") as f:
                for offset in sorted(offsets):
                    f.seek(offset)
                    byte = f.read(1)
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ 0x40]))
        self.corrupted[step] = self.now()
        return step

    def _cut_off(self, target: str, fault: _Active | None) -> bool:
        """Whether another fault has ``target``'s link down just now (a call to its agent would
        hang until its deadline, and the runner with it)."""
        return any(a is not fault and a.record.kind == "network-cut" and a.record.target == target
                   and a.undo is not None for a in self.faults)

    def _follow_faults(self) -> None:
        now = self.now()
        current = self.rounds[-1] if self.rounds else None
        for a in self.faults:
            r = a.record
            if a.undo is not None and a.undo_at is not None and now >= a.undo_at and self._cut_off(r.target, a):
                a.undo_at = now + UNDO_RETRY_S  # its agent is behind a cut link: undo it once the link is back
            elif a.undo is not None and a.undo_at is not None and now >= a.undo_at:
                undo, a.undo = a.undo, None
                a.undone_at = now
                try:
                    undo()
                except Exception as exc:
                    a.undo_tries += 1
                    if a.undo_tries < UNDO_TRIES:
                        # Its target may be behind another fault for a moment (an agent behind a
                        # cut link cannot be told to clear a GPU fault): try again shortly.
                        a.undo, a.undo_at = undo, now + UNDO_RETRY_S
                        self.progress(f"! undoing {r.kind} on {r.target} failed ({type(exc).__name__}); "
                                      f"trying again in {UNDO_RETRY_S:g} s")
                    else:
                        self.notes.append(f"could not undo {r.kind} on {r.target} in {UNDO_TRIES} tries: "
                                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            if r.kind == "fill-disk":
                # The job does not stop for a full disk: it trains on and its saves fail. Detected
                # when the trainer reports a failed save; resumed at the first commit once freed.
                if r.detected_at is None:
                    failed = self._first_event_after("save_failed", r.injected_at)
                    if failed is not None and (a.undone_at is None or failed <= a.undone_at + 5.0):
                        r.detected_at = failed  # not a later fill's failure
                if r.detected_at is not None and r.resumed_at is None and a.undone_at is not None:
                    r.resumed_at = self._first_event_after("commit", a.undone_at)
                if r.detected_at is None and a.undone_at is not None and now - a.undone_at > 5.0 and not a.moot:
                    a.moot = True  # e.g. every worker was restarting meanwhile: nothing tried to save
                    r.detail += "; no checkpoint was attempted while the disk was full: no effect"
                    self.notes.append(f"fill-disk at {r.injected_at:.1f} s had no effect: no save while full")
                continue
            if r.kind in TRAINING_FAULTS:
                # The fault happens when its step runs (it was sent a few steps ahead): from the
                # previous step's record on. Detected when the trainer rolls back; resumed at the
                # first step after that.
                if r.detected_at is None and a.at_step is not None:
                    started = self._step_started(a.at_step, r.injected_at)
                    if started is not None:
                        r.injected_at, a.at_step = started, None
                if r.detected_at is None:
                    r.detected_at = self._first_event_after("rollback", r.injected_at)
                if r.detected_at is not None and r.resumed_at is None:
                    r.resumed_at = self._first_event_after("step", r.detected_at)
                continue
            if r.kind == "slow-worker":
                # Detected when the daemon names the node a straggler. The job never stops for it:
                # resumed is the first step after that (after the round without it, when excluded).
                named = next((x for x in self.rounds if x.number > a.round_before and "straggler" in x.reason
                              and f"node {r.target} drained" in x.reason), None)
                if r.detected_at is None and named is not None:
                    # Excluded between two polls: the daemon had named it by the time it decided.
                    r.detected_at = named.decided_at if named.decided_at is not None else named.t
                    self.straggler_seen.add(r.target)
                elif r.detected_at is None and r.target in self._stragglers():
                    r.detected_at = now
                    self.straggler_seen.add(r.target)
                last = self.rounds[-1] if self.rounds else None
                if r.detected_at is None and not a.moot and last is not None and last.number > a.round_before \
                        and r.target not in last.members:
                    # Another fault took the slowed node out of the world before it could be named:
                    # its slow-down ended with its worker.
                    a.moot = True
                    r.detail += "; the node left the world before it could be named a straggler: no effect"
                    self.notes.append(f"slow-worker at {r.injected_at:.1f} s had no effect: {r.target} left the "
                                      f"world (round {last.number}) before it could be named a straggler")
                if r.detected_at is not None and r.resumed_at is None:
                    if not self.s.cluster.exclude_stragglers:
                        r.resumed_at = self._first_event_after("step", r.detected_at)
                        continue
                    # Wait for the round that leaves it out, and a step of that world (the old
                    # world may still finish a step or two before its workers are stopped).
                    new = next((x for x in self.rounds if x.number > a.round_before and x.t >= r.detected_at), None)
                    if new is not None:
                        r.resumed_at = self._first_step_of_a_new_world(new.t)
                continue
            if r.detected_at is None:
                if r.kind in AGENT_FAULTS and a.undone_at is not None and (current is None or
                                                                          current.number == a.round_before):
                    if self._agent_adopted(r.target):  # its successor serves the same workers
                        r.detected_at = now
                elif r.kind == "kill-daemon":
                    term = self.cluster.leader_term()
                    if term is not None and term != a.leader_before:  # a new term, even under the old name
                        r.detected_at = now
                elif r.kind in ("kill-etcd", "lose-quorum"):
                    r.detected_at = r.injected_at  # nothing to detect: clients fail over or wait
                elif current is not None and current.number > a.round_before:
                    first = next(x for x in self.rounds if x.number > a.round_before)
                    r.detected_at = first.decided_at if first.decided_at is not None else first.t
            if r.detected_at is not None and r.resumed_at is None:
                adopted = r.kind in AGENT_FAULTS and (current is None or current.number == a.round_before)
                if r.kind in ("kill-daemon", "kill-etcd", "lose-quorum") or adopted:  # the workers train on
                    r.resumed_at = self._first_event_after("step", r.detected_at)
                else:
                    r.resumed_at = self._first_step_of_a_new_world(r.detected_at)

    def _agent_adopted(self, node: str) -> bool:
        """The node's agent answers again and runs workers (the ones it adopted)."""
        try:
            status = self.cluster.status(node)
        except Exception:  # not registered or not serving yet
            return False
        return any(w.state == agent_pb2.WORKER_RUNNING for w in status.workers)

    def _first_step_of_a_new_world(self, t: float) -> float | None:
        """The first step after ``t`` of a world that started after ``t`` (its restore, or its
        in-place re-form, is recorded after ``t``): a step the old world finishes while its
        workers are being stopped does not count as resumed."""
        start = min((float(e["t"]) - self.t0 for e in self.events  # type: ignore[arg-type]
                     if e.get("event") in ("restore", "reform") and float(e["t"]) - self.t0 > t),  # type: ignore[arg-type]
                    default=None)
        return None if start is None else self._first_event_after("step", start)

    def _stragglers(self) -> set[str]:
        try:
            status = self.cluster.daemon_status()
        except Exception:  # etcd between members: next time
            return set()
        return {st.node_id for st in status.stragglers} if status is not None else set()

    def _step_started(self, step: int, since: float) -> float | None:
        """When ``step`` began after ``since``: the record of the step before it (None: not run yet)."""
        after = [e for e in self.events if float(e["t"]) - self.t0 >= since]  # type: ignore[arg-type]
        at = next((i for i, e in enumerate(after) if e.get("event") in ("step", "fault") and e.get("step") == step),
                  None)
        if at is None:
            return None
        before = [float(e["t"]) - self.t0 for e in after[:at]  # type: ignore[arg-type]
                  if e.get("event") == "step" and e.get("step") == step - 1]
        return before[-1] if before else since

    def _first_event_after(self, kind: str, t: float) -> float | None:
        times = [float(e["t"]) - self.t0 for e in self.events if e.get("event") == kind]  # type: ignore[arg-type]
        return min((x for x in times if x > t), default=None)

    # -- results ---------------------------------------------------------------------------------

    def _result(self) -> _Result:
        from stalwart.trainer.record import committed_steps, skipped_samples  # the record's format is the trainer's

        # The job's wall time ends with its last commit; the runner may wait on after it for a
        # fault's undo (an agent to restart, a disk to free), which is not the job's time.
        final = [float(e["t"]) - self.t0 for e in self.events  # type: ignore[arg-type]
                 if e.get("event") == "commit" and e.get("step") == self.s.job.steps]
        wall = min(final) if final else self.now()
        committed = committed_steps(self.events)
        samples = [Sample(float(e["t"]) - self.t0, int(e["step"]), int(e["world_size"]),  # type: ignore[arg-type]
                          loss=float(e["loss"])) for e in self._steps()]  # type: ignore[arg-type]
        _label_rounds(samples, self.rounds)
        last_commit = max((int(e["step"]) for e in self.events if e.get("event") == "commit"),  # type: ignore[call-overload]
                          default=0)
        lost, corrupt_loads = self._losses_of_restores()
        # (epoch, sample): a long run goes through the data more than once
        used = [(int(ev.get("epoch", 0)), i) for ev in committed.values()  # type: ignore[call-overload]
                for i in ev.get("samples", [])]  # type: ignore[union-attr]
        expected = self.s.job.steps * self.s.job.global_batch
        report = RunReport(
            scenario=self.s.name, wall_s=wall, target_steps=self.s.job.steps, samples=samples,
            faults=[a.record for a in self.faults], rounds=self.rounds, final_committed_step=last_commit,
            lost_committed_steps=lost, corrupt_loads=corrupt_loads, notes=self.notes,
            stragglers=sorted(self.straggler_seen | self._stragglers()),
            rollbacks=sum(e.get("event") == "rollback" for e in self.events),
        )
        report.account()
        report.restores = [
            RestoreSource(round(float(e["t"]) - self.t0, 3), int(e["step"]), int(e["world_size"]),  # type: ignore[arg-type, call-overload]
                          int(e.get("world_host_bytes", 0)), int(e.get("world_peer_bytes", 0)),  # type: ignore[call-overload]
                          int(e.get("world_disk_bytes", 0)),  # type: ignore[call-overload]
                          "memory generation" if e.get("source") == "memory" else "checkpoint")
            for e in self.events if e.get("event") == "restore" and int(e.get("step", 0)) > 0]  # type: ignore[call-overload]
        report.startup_phases = self._startup_phases()
        skipped = skipped_samples(self.events)
        report.skipped_samples = sum(len(v) for v in skipped.values())
        report.checks["reached the last step"] = self._finished()
        used_in = set(used)
        skipped_in = {(e, i) for e, ids in skipped.items() for i in ids}
        report.checks["every sample used exactly once"] = (
            len(used) == len(set(used)) and (len(used) == expected or not self._finished())
            and sorted(committed) == list(range(1, len(committed) + 1)) and not used_in & skipped_in)
        report.checks["no corrupt checkpoint loaded"] = corrupt_loads == 0
        report.checks["no committed step lost"] = lost == 0
        effective = [a for a in self.faults if not a.moot]
        report.checks["every fault detected"] = all(a.record.detected_at is not None for a in effective)
        report.checks["resumed after every fault"] = all(a.record.resumed_at is not None for a in effective)
        losses = {k: float(v["loss"]) for k, v in committed.items()}  # type: ignore[arg-type]
        rolled = [int(e["step"]) for e in self.events if e.get("event") == "rollback"]  # type: ignore[call-overload]
        if rolled:
            # Skipped data changes every later loss: only the steps before it can match the reference.
            losses = {k: v for k, v in losses.items() if k <= min(rolled)}
            self.notes.append(f"losses compared up to step {min(rolled)}, the first rollback")
        return _Result(report, losses)

    def _startup_phases(self) -> dict[str, float]:
        """The first world's start by phase (its rank 0's startup record; none: empty)."""
        first = next((e for e in self.events if e.get("event") == "startup"), None)
        if first is None:
            return {}
        spawned = float(first["timings"]["process_started_at"]) - self.t0  # type: ignore[index, call-overload]
        return {"cluster up, first round, spawn": round(max(0.0, spawned), 3),
                **{k: round(float(v), 3) for k, v in first["phases"].items()}}  # type: ignore[union-attr]

    def _losses_of_restores(self) -> tuple[int, int]:
        """Committed steps lost by restores (beyond the checkpoints corrupted on purpose), and
        restores that loaded a corrupted checkpoint.

        Corruption is a point in time: a restore before it, or of the same step committed again
        after it (the loader set the bad one aside and training saved that step anew), is fine.
        So is a re-form that took the whole step from its own memory (no byte read from disk).
        """
        lost = corrupt = 0
        commits: set[int] = set()
        bad: set[int] = set()
        flips = sorted((t, step) for step, t in self.corrupted.items())
        for e in self.events:
            at = float(e["t"]) - self.t0  # type: ignore[arg-type]
            while flips and flips[0][0] <= at:
                bad.add(flips.pop(0)[1])
            if e.get("event") == "commit":
                step = int(e["step"])  # type: ignore[call-overload]
                commits.add(step)
                bad.discard(step)
            elif e.get("event") in ("restore", "rollback"):  # a re-form's load is its restore event
                step = int(e["step"])  # type: ignore[call-overload]
                # read some of it from disk (on any rank), and took it
                if step in bad and e.get("world_disk_bytes", e.get("disk_bytes", 1)):
                    corrupt += 1
                good = [c for c in commits if c not in bad]
                if good and max(good) > step:
                    lost += max(good) - step
        return lost, corrupt


def _label_rounds(samples: list[Sample], rounds: list[RoundChange]) -> None:
    for i, s in enumerate(samples):
        number = 0
        for r in rounds:
            if r.t <= s.t:
                number = r.number
        samples[i] = Sample(s.t, s.step, s.world, number, s.loss)


def _reference_of(scenario: Scenario) -> Scenario:
    """The fault-free twin of ``scenario``, only as long as the comparison needs: losses are
    compared up to the first rollback (skipped data changes every later one), and a NaN or a
    spike planned for a step rolls back there (a few steps of margin). The job's learning rate
    and data order do not depend on its length."""
    planned = [f.at_step for f in scenario.faults if f.kind in TRAINING_FAULTS and f.at_step is not None]
    random_training = scenario.random is not None and bool(set(scenario.random.kinds) & set(TRAINING_FAULTS))
    steps = scenario.job.steps if not planned or random_training else min(scenario.job.steps, min(planned) + 5)
    return replace(scenario, faults=(), random=None, job=replace(scenario.job, steps=steps))


def _losses_match(losses: dict[int, float], reference: dict[int, float], report: RunReport) -> bool:
    worst = 0.0
    for step, loss in losses.items():
        ref = reference.get(step)
        if ref is None:
            report.notes.append(f"step {step} has no reference loss")
            return False
        worst = max(worst, abs(loss - ref) / max(abs(ref), 1e-12))
    report.notes.append(f"largest relative loss difference from the fault-free run: {worst:.2e}")
    return worst <= LOSS_RTOL
