"""The agent's membership decisions as pure functions: facts in, a decision with its reason out.

The node agent (``node.py``) gathers the facts — process states, connections, stall verdicts,
spares, the round — and applies what these functions decide. Nothing here reads a clock, a
process table or etcd, so every rule is tested with plain values.

The rules follow one principle: **an agent acts only on local facts about its own processes**.
It never kills a healthy worker because some other process is slow; who belongs to the world is
the daemon's decision alone.

- **Keep or replace at a new round** (:func:`keep_verdict`): a worker is kept (sent a Reform) when
  its process runs, is connected and can re-form. A stalled worker whose process is running is
  kept too: it is most likely blocked in a collective with the rank that really hung, which is
  stopped, or dead, and is replaced.
- **A re-form that takes long** (:func:`overdue_reform`): a worker told to re-form that has not
  acknowledged after ``reform_timeout`` is killed if its process is stopped, has lost its channel
  to the agent, or never said it began (left its old world); one that said so waits for its peers
  (a joiner still warming up, a survivor finishing its step), so it waits on, however long. A
  newer round supersedes the re-form; the trainer's own join deadline is the last backstop.
  ``reform_timeout`` must exceed the collective timeout: a survivor blocked in a collective with a
  lost peer begins only once that collective gives up.
- **When spares start** (:func:`spares_may_start`): once this node's workers have all made a step
  of the current round: not before the first round (the job's start is the slowest moment of
  all), and not while a worker is still starting or re-forming, since on a node's few CPU cores
  a spare importing torch beside it only slows the step the whole world waits for. A node
  warming to join, or replacing a lost worker, starts them at once. Spares that warm niced
  (``spare_nice``, where the agent may give their priority back) take only what CPU the workers
  leave: they start as soon as the node's workers run in a round, so they are warm by the first
  fault rather than seconds after it.
- **A stale worker** (:func:`stale_hello`): a process that says Hello as a worker of a round
  older than the current one, for a local rank that another live process of this node holds, is
  a worker the job left behind (one an agent before this one was stopping when it handed off): it
  is fenced (killed), never given the channel of the worker that holds its place now.
- **Ready to join** (:func:`join_readiness`): once the job has had a round, a node outside the
  current one (or after it closed) asks to be left out (its health record says ``replacing``)
  until it has a warm spare for each of its workers, so the daemon admits it only once it can join
  without making the world wait for a cold start.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ProcState(Enum):
    RUNNING = "running"  # running or sleeping: it can still act
    STOPPED = "stopped"  # SIGSTOP, a cgroup freezer
    EXITED = "exited"  # zombie, dead, or gone


@dataclass(frozen=True)
class WorkerFacts:
    """What the agent knows of one of its workers when a new round comes."""

    running: bool  # the agent's own view: started and not yet reaped
    stopping: bool  # the agent already began stopping it
    local_rank: int
    connected: bool  # its progress stream to the agent is open
    reforming: bool  # it was told to re-form and keeps its spare stream until it acknowledges
    stalled: bool  # the stall detector declared it stalled, with no step since
    proc: ProcState
    can_reform: bool  # its Hello said it handles Reform


@dataclass(frozen=True)
class Verdict:
    keep: bool
    why: str = ""
    unhealthy: bool = False  # killed at once rather than given its SIGTERM grace


KEEP = Verdict(True)


def keep_verdict(w: WorkerFacts, local_world_size: int) -> Verdict:
    """Whether ``w`` keeps its process in the new round (see the module docstring)."""
    if not w.running or w.stopping:
        return Verdict(False, "not running", True)
    if w.local_rank >= local_world_size:
        return Verdict(False, f"local rank {w.local_rank} is not in the new round")
    if not w.connected and not w.reforming:
        return Verdict(False, "not connected to the agent", True)
    if w.proc is ProcState.EXITED:
        return Verdict(False, "exited", True)
    if w.proc is ProcState.STOPPED:
        return Verdict(False, "stopped (SIGSTOP)" + (", stalled" if w.stalled else ""), True)
    if not w.can_reform and not w.reforming:
        return Verdict(False, "cannot re-form in place (no re-form handler)")
    return KEEP


@dataclass(frozen=True)
class Overdue:
    kill: bool
    why: str


def overdue_reform(proc: ProcState, connected: bool, waited: float, joining: bool, warming: bool = False) -> Overdue:
    """What to do with a worker whose re-form is not acknowledged ``waited`` seconds after the
    Reform was sent and past ``reform_timeout`` (see the module docstring). ``joining``: it said it
    left its old world and waits for its new round's peers. ``warming``: a spare given its rank
    before it was warm, still building its engine (it reads the Reform once warm; on a loaded host
    that can take longer than ``reform_timeout``), within the caller's patience."""
    if proc is ProcState.EXITED:
        return Overdue(False, "exited (its exit is handled as such)")
    if proc is ProcState.STOPPED:
        return Overdue(True, f"stopped (SIGSTOP) and not re-formed after {waited:.1f} s")
    if not connected:
        return Overdue(True, f"lost its channel to the agent and not re-formed after {waited:.1f} s")
    if warming:
        return Overdue(False, f"still warming up after {waited:.1f} s: it begins its re-form once warm")
    if not joining:
        return Overdue(True, f"did not begin its re-form within {waited:.1f} s")
    return Overdue(False, f"joining for {waited:.1f} s: waiting for its peers")


def stale_hello(*, hello_round: int, hello_pid: int, current_round: int | None, holder_pid: int | None,
                holder_running: bool, pending: bool) -> str | None:
    """Why a worker's Hello is from a stale process (see the module docstring), or None.
    ``holder_pid``: this node's worker of the Hello's local rank in the current round;
    ``pending``: the Hello's pid was sent a Reform (a spare taking a place, say) not yet acknowledged."""
    if current_round is None or holder_pid is None or holder_pid == hello_pid or not holder_running or pending:
        return None
    if hello_round >= current_round:
        return None
    return (f"pid {hello_pid} says Hello for round {hello_round}, but round {current_round}'s worker of its local "
            f"rank is pid {holder_pid}")


def refill_in_place(*, joining: bool, new_rank: int, warm_spare: bool, spares: int) -> bool:
    """Whether a worker that died after its Reform was sent is replaced within the same round
    (a spare takes its rank there) rather than the round failed (the daemon opens another).

    Only one that never began its re-form (``joining`` false): it never joined, so its place is
    not lost, and only with a warm spare to fill it (or none configured, where a new process is
    what would come anyway). One that died while joining may have broken its peers' group. So may
    the new round's rank 0 (``new_rank`` 0) in any case: its process can already host the round's
    store, on a port kept from an earlier round, so its peers' joins broke with it; they then wait
    for a newer round, and a rank 0 refilled in the same round would wait for them in vain."""
    return not joining and new_rank != 0 and (warm_spare or spares == 0)


@dataclass(frozen=True)
class JoinFacts:
    """What decides whether this node may be taken into a round now."""

    in_round: bool  # the current round is open and names this node
    started: bool  # the job has had a round (open or closed since): its next round is not its first
    workers: int  # local workers a round gives this node
    ready_spares: int  # warm spares, plus live workers of this node that can re-form
    spares_disabled: bool  # the command cannot run as a spare
    reform_in_place: bool
    warming_for: float | None  # seconds since this node began warming spares to join; None: not


@dataclass(frozen=True)
class Readiness:
    ready: bool
    why: str


def join_readiness(f: JoinFacts, replace_timeout: float) -> Readiness:
    """Whether a node outside the round is ready to be admitted (see the module docstring).

    A node inside the round, or before the job's first round (every node starts cold then), is
    always ready. After a round that closed for want of nodes it is not, until warm: the next
    round would otherwise wait for its cold start (a warm spare takes no longer to get ready than a
    new process, and costs no one a wait once it is)."""
    if f.in_round or not f.started:
        return Readiness(True, "in the round" if f.in_round else "the job's first round")
    if not f.reform_in_place:
        return Readiness(True, "joins by restarting every worker (reform_in_place = false)")
    if f.spares_disabled:
        return Readiness(True, "the command cannot run warm spares")
    if f.ready_spares >= f.workers:
        return Readiness(True, f"{f.ready_spares} warm spare(s) ready")
    if f.warming_for is not None and f.warming_for > replace_timeout:
        return Readiness(True, f"no warm spares within replace_timeout={replace_timeout:g} s: joining cold")
    return Readiness(False, f"warming: {f.ready_spares} of {f.workers} spare(s) ready")


def lost_before_step(gap: float, typical: float, after: str) -> tuple[str, float] | None:
    """The training time lost before a step, by cause, as this node's agent sees it: the whole
    wait less one normal step when it is the first step after a worker started (``after =
    "startup"``) or was told to re-form (``"re-form"``: leaving, joining, restoring); otherwise what
    a gap longer than twice the normal step exceeds it by (``"pause"``: a peer's fault, a stall, a
    slow save). None when nothing was lost. ``typical``: the recent median step time (0: unknown)."""
    if after in ("startup", "re-form"):
        lost = gap - typical
        return (after, lost) if lost > 0 else None
    if typical > 0 and gap > 2 * typical:
        return "pause", gap - typical
    return None


def spares_may_start(*, warming: bool, replacing: bool, workers: int, stepped: int, niced: bool = False) -> bool:
    """Whether the spare pool may start processes now (see the module docstring). ``workers``:
    this node's workers in the current round (0: none); ``stepped``: how many of them reported a
    step in it; ``niced``: spares warm at a lower priority than the workers."""
    return warming or replacing or (workers > 0 and (niced or stepped >= workers))


def ring_neighbours(members: list[str], me: str, k: int) -> list[str]:
    """The ``k`` members after ``me`` in the round's order, wrapping around (fewer in a smaller
    world; none when ``me`` is not a member). Each member is so checked by the ``k`` before it:
    a lost one is found by someone, and a check costs O(k), not O(world size)."""
    if me not in members:
        return []
    i, n = members.index(me), len(members)
    return [members[(i + j) % n] for j in range(1, min(k, n - 1) + 1)]
