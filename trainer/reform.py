"""In-place re-form: the world a surviving (or spare) worker joins without restarting.

The agent learns a new round from the daemon and tells each of its workers, over the local
progress channel, which rank of which world it now holds (``AgentCommand.reform``). A worker
that stays keeps its imported torch/DeepSpeed, its model and its host copy of the last committed
checkpoint, so re-forming costs a process-group set-up and an engine rebuild instead of a restart.

This module imports nothing heavy: the agent side builds :class:`ReformSpec` values from its
protobuf messages without paying for torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from stalwart.proto.contract import ENV_ROUND, ENV_SPARE, EXIT_STUCK
from stalwart.trainer.world_sockets import world_sockets

log = logging.getLogger(__name__)

# A join or world formation still blocked this long after its connections were first cut is in a
# call nothing can interrupt (gloo retrying a connection a dead peer refuses, each try a new
# socket, until its timeout): the process exits with EXIT_STUCK for a spare to take its rank.
STUCK_AFTER_BREAK_S = 2.0


def exit_stuck() -> None:
    """Exit with :data:`EXIT_STUCK` now: the main thread is blocked in C++ and cannot unwind."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_STUCK)

# ENV_SPARE ``1``: the worker is a warm spare; it has no rank until the agent assigns one.


@dataclasses.dataclass(frozen=True)
class ReformSpec:
    """One worker's place in a new round.

    ``round`` is the round number: it names the rendezvous keys of this world, so a store
    reused across rounds never hands out a previous round's keys. ``restore_step`` is the
    committed checkpoint the round restores (``None``: the newest committed one).
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    round: int
    local_rank: int = 0
    restore_step: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master port {self.master_port} is not a TCP port")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ReformSpec:
        """The torchrun environment of this process as a spec (round from ``STALWART_ROUND``)."""
        env = dict(os.environ) if env is None else env
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env["MASTER_PORT"]),
                   round=int(env.get(ENV_ROUND, "0")), local_rank=int(env.get("LOCAL_RANK", "0")))

    @classmethod
    def from_proto(cls, reform: Any, *, local_rank: int = 0) -> ReformSpec:
        """From an ``agent_pb2.Reform`` message (``round`` is its ``RoundRecord``)."""
        rnd = reform.round
        return cls(rank=int(reform.rank), world_size=int(reform.world_size), master_addr=rnd.master_addr,
                   master_port=int(rnd.master_port), round=int(rnd.number), local_rank=local_rank,
                   restore_step=int(rnd.restore_step) if rnd.has_restore_step else None)

    def env(self) -> dict[str, str]:
        """The torchrun variables of this world (what DeepSpeed and user code read)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                ENV_ROUND: str(self.round)}


def is_spare(env: dict[str, str] | None = None) -> bool:
    """Whether this process was started as a warm spare (``STALWART_SPARE=1``)."""
    return (os.environ if env is None else env).get(ENV_SPARE, "0") == "1"


# --- joining and leaving a world (imports torch on use) ------------------------------------------

_COLLECTIVE_ERROR_MARKS = (
    "connection closed by peer", "read error", "connection reset", "broken pipe", "timed out",
    "connection refused", "no route to host", "gloo/transport",
)

_shm_op: list[Any] = []
"""DeepSpeed's shared-memory comm extension, loaded once: loading it again (``build_shm_op``,
≈0.5 s of JIT-build checks) is most of what a new DeepSpeed backend object costs. It serves
only ``inference_all_reduce`` and keeps the world it was first set up for (its ``initialize``
runs once per process); training never uses it."""

_hosted_stores: dict[int, Any] = {}
"""TCPStore servers this process hosts, by port: a rank 0 that is rank 0 again on the same port
reuses its server (a second one could not bind), and servers of earlier rounds live on so a late
peer of that round fails on its own timeout rather than on a refused connection."""


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or hung peer seen through a collective (gloo raises
    ``RuntimeError`` with "Connection closed by peer"/"Read error" when a peer dies and
    "Timed out" after the group timeout when one hangs; NCCL raises ``DistBackendError``)."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistNetworkError", None)) if k is not None)
    if kinds and isinstance(exc, kinds):
        return True
    if not isinstance(exc, RuntimeError | ConnectionError | TimeoutError):
        return False
    text = str(exc).lower()
    return any(mark in text for mark in _COLLECTIVE_ERROR_MARKS)


_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")


def peer_hosts(exc: BaseException) -> list[str]:
    """The peer addresses a collective error names (gloo: "Connection closed by peer
    [10.0.0.7]:41234"), in order, without repeats."""
    seen: list[str] = []
    for host in _PEER_ADDRESS.findall(str(exc)):
        if host not in seen and any(c.isdigit() for c in host):
            seen.append(host)
    return seen


def leave_world() -> None:
    """Destroy every process group of this process and DeepSpeed's cached view of them.

    ``deepspeed.comm.destroy_process_group`` destroys torch's groups (the default one, the
    trainer's control group, the commit coordinator's, DeepSpeed's clone of the world) and drops
    DeepSpeed's group references; ``cdb`` (DeepSpeed's backend object) is reset too, because it
    caches the world's size and rank (its shared-memory op was set up for the old world).
    A rank of a broken world must be able to leave: errors are logged, not raised.
    """
    import logging

    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.utils import groups

    logger = logging.getLogger(__name__)
    world_sockets.cut()  # a peer still waiting on this rank fails now, not at its timeout
    try:
        if ds_comm.cdb is not None and dist.is_initialized():
            ds_comm.destroy_process_group()
        elif dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may refuse a clean teardown
        logger.warning("leaving the old world: %s: %s", type(exc).__name__, exc)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as again:  # noqa: BLE001
                logger.warning("destroying the default group again: %s", again)
    groups._release_process_group_references(group=None)
    if ds_comm.cdb is not None and not _shm_op:
        _shm_op.append(getattr(ds_comm.cdb, "shm_comm_op", None))
    ds_comm.cdb = None


def store_ports() -> set[int]:
    """Ports of the rendezvous stores this process uses or hosts (their connections outlive a
    world: see :mod:`~stalwart.trainer.world_sockets`)."""
    ports = set(_hosted_stores)
    if os.environ.get("MASTER_PORT", "").isdigit():
        ports.add(int(os.environ["MASTER_PORT"]))
    return ports


class JoinSuperseded(Exception):
    """A newer round came while this process waited for its peers: join that one instead.
    ``built``: what :func:`within_round` had made of the superseded world when it was broken (an
    engine to release), or None."""

    def __init__(self, round: int, built: Any = None) -> None:
        super().__init__(f"round {round} was superseded while its peers were arriving")
        self.round = round
        self.built = built


def within_round(round_number: int, superseded: Callable[[], bool], form: Callable[[], Any], *,
                 stuck_after: float = STUCK_AFTER_BREAK_S, exit_process: Callable[[], object] = exit_stuck) -> Any:
    """Run ``form()`` (the rest of forming a joined world: building the engine, whose DeepSpeed
    groups rendezvous on the store like the join, and restoring, whose collectives wait on every
    peer) under the breaker that :func:`join_world` runs its join under, and return what it
    returns.

    Why: a world can be superseded after its join finished, while it builds its engine, and a
    peer of it that died or hung meanwhile would hold the others in ``new_group`` or in the
    restore's collectives until their timeout (and the agent, seeing no re-form begun, kills
    them). Broken here instead, ``form`` fails at once and :class:`JoinSuperseded` is raised,
    carrying whatever ``form`` returned if it finished regardless (the caller releases it and
    leaves the world before joining the newer round). ``form`` still blocked ``stuck_after``
    seconds after the break began cannot be broken: ``exit_process`` is called (see
    :data:`STUCK_AFTER_BREAK_S`)."""
    breaker = _JoinBreaker(superseded, hosted=_hosted_stores, stuck_after=stuck_after, exit_process=exit_process)
    built = None
    try:
        built = form()
    except Exception:
        if not breaker.fired:
            raise
    finally:
        breaker.stop()
    if breaker.fired:
        raise JoinSuperseded(round_number, built)
    return built


def join_world(spec: ReformSpec, *, backend: str, collective_timeout_s: float, join_timeout_s: float,
               superseded: Callable[[], bool] = lambda: False,
               on_wait: Callable[[int, int], None] | None = None) -> None:
    """Start this process's default process group as ``spec`` says, from a store of our own.

    Rank 0 hosts a ``TCPStore`` on the round's port (or reuses the one it hosts there already);
    the others connect to it, waiting up to ``join_timeout_s`` for it. Every round uses its own
    key prefix (``round-<n>/``): torch's rendezvous keys would otherwise collide with a previous
    round's on a reused store. ``collective_timeout_s`` becomes the groups' timeout: gloo's bound
    on how long a collective waits for a hung peer. It is also made torch's default for groups
    created later without a timeout (DeepSpeed's clone of the world group, which carries ZeRO's
    gradient reductions, would otherwise wait 30 minutes).

    Before the process group is made, every rank waits in an arrival barrier of its own on the
    store, polled: gloo's rendezvous cannot be interrupted, this wait can. While peers are still
    arriving (a joiner warming up, a survivor finishing its step) nothing times out but
    ``join_timeout_s``; when ``superseded()`` turns true (a newer round came) the wait ends with
    :class:`JoinSuperseded` and nothing of this round is left behind but its store keys.
    ``on_wait(arrived, world_size)`` is called about once a second while waiting.
    """
    import datetime
    import importlib

    import deepspeed
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if dist.is_initialized():
        raise RuntimeError("join_world: this process is still in a world (call leave_world first)")
    os.environ.update(spec.env())
    world_sockets.joining()
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    c10d.default_pg_timeout = timeout  # groups made later without a timeout (see the docstring)
    # init_process_group names the default group after a counter that it bumps first: one that
    # failed (a broken or superseded join) left it at 1, and this rank's rendezvous keys would then
    # never meet those of a peer on its first join (gloo waits out its timeout).
    c10d._world.group_count = 0
    def join() -> None:
        if spec.rank == 0 and spec.master_port not in _hosted_stores:
            _hosted_stores[spec.master_port] = _host_store(spec, join_timeout_s, superseded)
        # A client of its own for every join, rank 0's too: a join that has to be broken cuts its
        # client's connection while the server lives on for the rounds after.
        store = _connect_store(spec, join_timeout_s, superseded)
        prefixed = dist.PrefixStore(f"round-{spec.round}/", store)
        _arrive(prefixed, spec, join_timeout_s, superseded, on_wait)
        dist.init_process_group(backend, store=prefixed, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        # DeepSpeed wraps the initialized torch world in a fresh backend object (``cdb``).
        ds_torch = importlib.import_module("deepspeed.comm.torch")  # ``deepspeed.comm.torch`` is torch itself
        build = ds_torch.build_shm_op
        if _shm_op:
            ds_torch.build_shm_op = lambda: _shm_op[0]  # see _shm_op
        try:
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout, auto_mpi_discovery=False)
        finally:
            ds_torch.build_shm_op = build

    # A join superseded for a moment is broken (see _JoinBreaker), wherever it blocks: a store
    # call to a host behind a cut link waits for TCP, gloo's rendezvous for its timeout, neither
    # of them for a newer round.
    try:
        within_round(spec.round, superseded, join)
    except JoinSuperseded:
        if dist.is_initialized():  # it formed after all, as the cut came: leave it
            leave_world()
        raise


class _JoinBreaker:
    """Watches a join that may block where it cannot be interrupted (a store call to a host
    behind a cut link, gloo's rendezvous inside ``init_process_group``): once the round has been
    superseded for ``grace`` seconds and the join still has not finished (a peer of the full
    roster died, hung or sits behind a cut link), its connections are cut, again until it gives
    up (:meth:`~stalwart.trainer.world_sockets.WorldSockets.cut_join`), so it fails now instead of
    at a timeout and the rank joins the newer round. The grace is short: a superseded round never
    trains (its ranks re-form at their first step boundary even when the join finishes), so
    waiting on it only delays the newer one; it lets a join that is about to finish do so rather
    than fail half-connected. ``hosted``: the stores this process hosts (live, as rank 0 may add
    the round's), whose server side lives on. Still blocked ``stuck_after`` seconds into the
    break, the join cannot be broken at all: ``exit_process``."""

    def __init__(self, superseded: Callable[[], bool], hosted: Mapping[int, object], grace: float = 0.25, *,
                 stuck_after: float = STUCK_AFTER_BREAK_S, exit_process: Callable[[], object] = exit_stuck) -> None:
        self.fired = False
        self._superseded, self._hosted, self._grace = superseded, hosted, grace
        self._stuck_after, self._exit_process = stuck_after, exit_process
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="stalwart-join-breaker")
        self._thread.start()

    def _watch(self) -> None:
        since: float | None = None
        while not self._done.wait(0.05):
            if not self._superseded():
                since = None
                continue
            since = time.monotonic() if since is None else since
            if time.monotonic() - since >= self._grace:
                self._break(time.monotonic() - since)
                return

    def _break(self, superseded_for: float) -> None:
        self.fired = True
        log.warning("the round being joined was superseded %.1f s ago and its join has not finished: breaking it",
                    superseded_for)
        cut, began = 0, time.monotonic()
        while True:  # gloo retries a connection to a peer that does not answer, a new socket each time
            cut += world_sockets.cut_join(set(self._hosted))
            if self._done.wait(0.05):
                break
            if time.monotonic() - began >= self._stuck_after:
                log.error("the superseded join is still blocked %.1f s after its connections were cut (%d so far): "
                          "it cannot be broken; exiting (code %d) for a spare to take this rank", self._stuck_after,
                          cut, EXIT_STUCK)
                self._exit_process()
                return
        log.info("cut %d connection(s) of a join that a newer round superseded", cut)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _arrive(store: Any, spec: ReformSpec, timeout_s: float, superseded: Callable[[], bool],
            on_wait: Callable[[int, int], None] | None) -> None:
    """Join ``spec``'s arrival roster and wait until it is full (see :func:`join_world`).

    The roster is a counter on the store (``add`` is atomic) and a ``full`` mark set by the rank
    that fills it, so arriving, leaving and filling are atomic and cost O(1) store operations a
    rank, whatever the world size. Once the roster is full nobody can leave it (every rank will
    call ``init_process_group``, which cannot be interrupted); a rank superseded before that
    takes itself off again, so nobody else enters a world it will never join. A superseded rank
    that finds the roster filled meanwhile joins this round anyway: its newer Reform is applied at
    the first step boundary, like any other. Each rank arrives once: a replacement of a rank whose
    first process died after arriving finds its mark and does not count twice."""
    import os
    import time

    me = str(os.getpid()).encode()
    mark = f"arrived/{spec.rank}"
    if store.compare_set(mark, "", me) == me:  # not counted yet (a dead predecessor would be)
        if store.add("count", 1) >= spec.world_size:
            store.set("full", b"1")
    start = last_report = time.monotonic()
    pause, most = 0.002, min(0.5, max(0.02, spec.world_size * 0.0005))  # polls on rank 0's store stay bounded
    while not store.check(["full"]):
        now = time.monotonic()
        if superseded():
            owner = store.compare_set(mark, me, b"")  # take our mark back, if it is ours
            if owner == b"" and store.add("count", -1) + 1 >= spec.world_size:
                store.compare_set(mark, b"", me)  # it had filled: this rank is in after all
                store.add("count", 1)
                break
            raise JoinSuperseded(spec.round)
        if now - start > timeout_s:
            arrived = store.add("count", 0)
            raise TimeoutError(f"round {spec.round}: {arrived} of {spec.world_size} ranks arrived within "
                               f"{timeout_s:g} s")
        if on_wait is not None and now - last_report >= 1.0:
            last_report = now
            on_wait(int(store.add("count", 0)), spec.world_size)
        time.sleep(pause)
        pause = min(most, pause * 2)


def _host_store(spec: ReformSpec, timeout_s: float, superseded: Callable[[], bool]) -> Any:
    """Rank 0's store server on the round's port. The port may still be held for a moment by the
    process that had this rank before (it is being stopped, off its agent's main loop): retry
    while it is in use, until ``timeout_s`` or a newer round."""
    import datetime
    import time

    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dist.TCPStore(spec.master_addr, spec.master_port, None, True,
                                 timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        except RuntimeError as exc:  # DistNetworkError is a RuntimeError
            if "in use" not in str(exc).lower() or time.monotonic() > deadline:
                raise
            if superseded():
                raise JoinSuperseded(spec.round) from None
            time.sleep(0.05)


CONNECT_TRY_S = 2.0  # one try of a store client's connection (see _connect_store)


def _connect_store(spec: ReformSpec, timeout_s: float, superseded: Callable[[], bool]) -> Any:
    """A client of the round's store (rank 0's), connected in short tries: TCPStore's own connect
    retries for its whole timeout (the join's, minutes) when the host resets it (it died, or sits
    behind a cut link), and nothing interrupts it; between tries a newer round ends the wait."""
    import datetime
    import time

    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        _wait_listening(spec.master_addr, spec.master_port, max(0.0, deadline - time.monotonic()), superseded,
                        spec.round)
        try:
            store = dist.TCPStore(spec.master_addr, spec.master_port, None, False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=max(0.1, min(CONNECT_TRY_S,
                                                                                   deadline - time.monotonic()))))
        except RuntimeError:  # DistNetworkError is a RuntimeError
            if superseded():
                raise JoinSuperseded(spec.round) from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store


def _wait_listening(addr: str, port: int, timeout_s: float, superseded: Callable[[], bool] = lambda: False,
                    round: int = 0) -> None:
    """Poll until rank 0's store accepts connections (every 10 ms; TCPStore's own retry backs off
    to about a second, most of a re-form's time when a peer asks before the host listens)."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            if superseded():
                raise JoinSuperseded(round) from None
            if time.monotonic() > deadline:
                return  # TCPStore raises the error, with its own message
            time.sleep(0.01)
