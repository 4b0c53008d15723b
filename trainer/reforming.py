"""The in-place re-form, the trainer's side: leave a broken or changing world, join the next.

:class:`ReformingMixin` is the part of :class:`~stalwart.trainer.Trainer` that takes the agent's
Reform (thread-safe, from the agent client's thread), aborts an old world that a stuck step would
otherwise hold until the collective timeout, waits for a Reform after a collective failed, and
moves the process to the new world: it leaves the old one (in-flight save, engine, process
groups), joins the new one, gives way to a newer round that supersedes it or breaks it while it
forms, rebuilds the engine and restores the last committed checkpoint. How the members of a
round find each other and form their groups is ``reform.py``'s (the join protocol).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from stalwart.ckpt import CheckpointError, CommitFailed
from stalwart.proto.contract import EXIT_STUCK
from stalwart.trainer.batching import accumulation_steps
from stalwart.trainer.config import ReformTimings
from stalwart.trainer.engine import _release_engine, backend_for_device
from stalwart.trainer.errors import ReformFailed, TrainerError
from stalwart.trainer.reform import (
    JoinSuperseded,
    ReformSpec,
    exit_stuck,
    is_collective_error,
    join_world,
    leave_world,
    store_ports,
    within_round,
)
from stalwart.trainer.world_sockets import world_sockets

log = logging.getLogger(__name__)


def _abort_all_groups() -> None:
    """Abort every process group (NCCL: ``ncclCommAbort``); experimental in torch."""
    from torch.distributed.distributed_c10d import _abort_process_group

    try:
        _abort_process_group()
    except Exception as exc:  # noqa: BLE001 - the collective timeout still bounds the wait
        log.error("aborting the process groups failed: %s: %s", type(exc).__name__, exc)


def _cut_old_world() -> None:
    """gloo's stand-in for an abort: its blocked receives fail once their connections are shut."""
    world_sockets.cut(keep_ports=store_ports())


# Where the innermost Python frame of a thread in a collective's native call is: torch's
# distributed module, DeepSpeed's comm layer, or the collective timer's wrapped ``Work.wait``.
_COLLECTIVE_CODE = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}deepspeed{os.sep}comm{os.sep}",
                    f"{os.sep}collective_timer.py")


def _call_in_collective(thread_id: int | None) -> tuple[object, int] | None:
    """The innermost Python frame of thread ``thread_id`` and its instruction, if that frame is a
    collective's (see ``_COLLECTIVE_CODE``): the thread is then in the collective's native call.
    The same frame at the same instruction later means it is still in that one call."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None or not any(part in frame.f_code.co_filename for part in _COLLECTIVE_CODE):
        return None
    return frame, frame.f_lasti


class ReformingMixin:
    """Mixed into :class:`~stalwart.trainer.Trainer`: its Reform state is set up by its constructor,
    and a re-form ends in its ``_attach``, ``_restore`` and ``_resume`` for the new world."""

    def request_reform(self, spec: ReformSpec) -> None:
        """Ask this rank to move to ``spec``'s world at the next step boundary (or at once, when a
        collective failed). The agent client's Reform handler; thread-safe. A round not newer
        than this rank's is ignored."""
        with self._reform_lock:
            pending = self._reform_spec
            if spec.round <= self.round or (pending is not None and spec.round <= pending.round):
                log.info("rank %d round %d: ignoring a Reform for round %d", self.rank, self.round, spec.round)
                return
            self._reform_spec = spec
            self._reform_event.set()
            leaves = self._leaves
        log.warning("rank %d round %d step %d: Reform to rank %d of %d in round %d", self.rank, self.round,
                    self.step, spec.rank, spec.world_size, spec.round)
        abort = _abort_all_groups if backend_for_device() == "nccl" else _cut_old_world
        threading.Thread(target=self._abort_if_stuck, args=(leaves, abort, spec.round), daemon=True,
                         name="stalwart-stuck-abort").start()

    def _abort_if_stuck(self, leaves: int, abort: Callable[[], object], target: int,
                        exit_process: Callable[[], object] = exit_stuck) -> bool:
        """After a Reform: if this rank's current step runs ``abort_stuck_after_s`` without the
        rank beginning to leave the old world (``leaves`` unchanged), its main thread is stuck in a
        collective on a lost peer: ``abort`` the old world (NCCL: every process group; gloo: its
        connections) so that the collective raises and :meth:`train` re-forms. A rank already
        re-forming is left alone: its join gives way to a newer round by itself; so is one that is
        in the Reform's round ``target`` already (a join superseded by it went on to it within the
        same leave, and the world left behind is that round's). Returns whether it aborted.

        A rank that has still not begun to leave as long again after the abort (at least 1 s),
        its training thread in one collective call all that time, calls ``exit_process``: gloo
        cannot interrupt a send partly written to a peer that stopped reading (a SIGSTOPped or
        frozen peer), not by shutting the connection down nor by the peer's death; it waits out
        ``collective_timeout_s``. Exiting with :data:`EXIT_STUCK` costs the job one spare taking
        this rank instead."""
        wait = self.config.abort_stuck_after_s
        if wait is None:
            wait = max(0.5, 3.0 * self._last_step_time)
        remaining = self._step_started + wait - time.perf_counter()
        if remaining > 0 and self._left_world.wait(remaining) and self._leaves != leaves:
            return False
        with self._reform_lock:  # held while aborting: the main thread cannot begin a join meanwhile
            if self._leaves != leaves or self._reforming or self.round >= target:
                return False
            log.error("rank %d round %d step %d: stuck in its step %.1f s, past %.1f s, after a Reform: "
                      "aborting the old world", self.rank, self.round, self.step,
                      time.perf_counter() - self._step_started, wait)
            abort()
        call, grace = self._collective_call(), max(wait, 1.0)
        deadline = time.monotonic() + grace
        while self._leaves == leaves and time.monotonic() < deadline:
            self._left_world.wait(0.05)
        if self._leaves != leaves:
            return True
        still = self._collective_call()
        if call is None or still is None or still[0] is not call[0] or still[1] != call[1]:
            # Not in one collective the whole time (a long native call of its own, such as an
            # optimizer step on the CPU): its next collective raises on the cut world.
            log.warning("rank %d round %d step %d: not yet out of its step %.1f s after the abort of its "
                        "world, but not stuck in a collective: it leaves at its next one", self.rank,
                        self.round, self.step, grace)
        else:
            log.error("rank %d round %d step %d: still stuck %.1f s after the abort of its world (a collective "
                      "that cannot be interrupted, on a hung peer): exiting (code %d) for a spare to take "
                      "its rank", self.rank, self.round, self.step, grace, EXIT_STUCK)
            exit_process()
        return True

    def _collective_call(self) -> tuple[object, int] | None:
        """The collective call the training thread is in now, if any (see ``_call_in_collective``)."""
        return _call_in_collective(getattr(self, "_step_thread", threading.main_thread().ident))

    @property
    def cannot_reform(self) -> str | None:
        """Why this process cannot move to another world in place (None: it can). A worker that
        cannot does not tell the agent it can, so the agent restarts it at a round change instead
        of sending it a Reform it would refuse."""
        if self._recipe is None:
            return "the engine was not built by Trainer.initialize, so it cannot be rebuilt"
        if self._recipe.unsupported:
            return f"cannot rebuild the engine: {self._recipe.unsupported}"
        if self.state.stage == 3 and self._recipe.skeleton is None:
            return "in-place re-form of ZeRO-3 needs the model's structure, which was not kept"
        return None

    def _take_reform(self) -> ReformSpec | None:
        with self._reform_lock:
            spec, self._reform_spec = self._reform_spec, None
            self._reform_event.clear()
            return spec

    def _await_reform(self, cause: BaseException) -> ReformSpec:
        """After a collective failed: the agent's Reform, or :class:`ReformFailed`; without an
        agent (``expects_reform`` false) the collective's error itself, at once."""
        if not self.expects_reform and not self._reform_event.is_set():
            raise cause
        deadline = time.monotonic() + self.config.reform_wait_s
        while not self._reform_event.wait(0.05) and time.monotonic() < deadline:
            if self._sigterm:
                # Stopped while its world is broken: there is nothing to save (the peers are gone),
                # and waiting for the agent's kill would hold its main loop up.
                log.warning("rank %d round %d step %d: SIGTERM while waiting for a Reform: exiting", self.rank,
                            self.round, self.step)
                raise SystemExit(0)
        if not self._reform_event.is_set():
            raise ReformFailed(
                f"rank {self.rank} round {self.round} step {self.step}: a collective failed ({cause}) and no "
                f"Reform arrived within {self.config.reform_wait_s:g}s", round=self.round,
            ) from cause  # fmt: skip
        spec = self._take_reform()
        assert spec is not None
        return spec

    def reform(self, spec: ReformSpec, *, cause: str = "reform", error_seen_at: float | None = None) -> ReformTimings:
        """Move this process to ``spec``'s world without restarting it.

        Leaves the old world (the in-flight save is abandoned if it is not done: a lost peer means
        it cannot commit; the old engine's hooks are removed; every process group and DeepSpeed's
        cached groups are destroyed), joins the new one (:func:`~stalwart.trainer.reform.join_world`),
        builds a DeepSpeed engine for the same model and optimizer recipe, and restores the newest
        committed checkpoint resharded to the new world (not capped at ``spec.restore_step``: the
        daemon learns of commits later than the disk has them, and a save committed meanwhile
        is progress to keep, and a step number the re-run would collide with): weights,
        optimizer, scheduler, loss scaler, counters, data position and RNG, exactly as a freshly
        started process of the new world would. The parts this process saved itself come from its
        host copy of that checkpoint's snapshot; the rest is read from disk and verified.
        Collective over the new world: every rank of it must be re-forming (or be a spare joining).
        Raises :class:`ReformFailed` (the agent then replaces this process).
        """
        timing = ReformTimings(round=spec.round, world_size=spec.world_size, rank=spec.rank, cause=cause,
                               error_seen_at=error_seen_at, started_at=time.time(), left_step=self.step)
        with self._reform_lock:
            self._leaves += 1
            self._reforming = True
        self._left_world.set()
        self._left_world.clear()
        try:
            return self._reform(spec, timing, cause)
        finally:
            with self._reform_lock:
                self._reforming = False

    def _reform(self, spec: ReformSpec, timing: ReformTimings, cause: str) -> ReformTimings:
        if self.cannot_reform is not None:
            raise ReformFailed(self.cannot_reform, round=spec.round)
        self._check_world(spec)
        log.warning("rank %d round %d step %d: re-forming as rank %d of %d (round %d, master %s:%d, cause %s)",
                    self.rank, self.round, self.step, spec.rank, spec.world_size, spec.round, spec.master_addr,
                    spec.master_port, cause)
        host = self.checkpointer.committed_snapshot()
        if self.peers is not None and host is not None:
            self.peers.keep_own(host, self.rank)  # a commit that step_done has not seen yet
        self._leave()
        timing.left_at = time.time()
        try:
            while True:
                try:
                    spec = self._join_newest(spec)
                    timing.round, timing.world_size, timing.rank = spec.round, spec.world_size, spec.rank
                    timing.group_up_at = time.time()
                    restored = within_round(spec.round, lambda r=spec.round: self._newer_reform(r),  # type: ignore[misc]
                                            lambda s=spec: self._form(s, timing, host))  # type: ignore[misc]
                    assert restored is not None
                    self._resume(restored)
                    break
                except JoinSuperseded:
                    # Superseded after its join, while it built its engine or restored (a peer of
                    # it lost meanwhile would hold this rank there): on to the newer round.
                    self._drop_partial_world()  # _attach took the engine first, if it was built
                    spec = self._superseded_by_newer(spec, "it formed")
                except (ReformFailed, TrainerError):
                    raise
                except Exception as exc:
                    # The restore's coordination (ckpt wraps it as CommitFailed) breaks like the
                    # join's collectives when a peer of the forming world is lost.
                    seen = exc.__cause__ if isinstance(exc, CheckpointError) else exc
                    if seen is None or (isinstance(exc, CheckpointError) and not isinstance(exc, CommitFailed)):
                        raise
                    timed_out = "timed out" in str(seen).lower() or "timeout" in str(seen).lower()
                    if not (self.expects_reform and is_collective_error(seen)) or timed_out:
                        raise  # a peer that never came (a timeout) fails this rank, as before
                    # A peer of the new round died while it formed (its store host, or a rank in
                    # the collectives after the roster): the round is lost, not this process.
                    # The daemon opens another; wait for it instead of failing as well.
                    log.error("rank %d: round %d broke while it formed (%s: %s); waiting for the next round",
                              spec.rank, spec.round, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    self._drop_partial_world()
                    spec = self._await_newer_reform(spec, exc)
        except ReformFailed:
            raise
        except (TrainerError, CheckpointError) as exc:
            raise ReformFailed(f"rank {spec.rank} cannot re-form into round {spec.round}: {exc}",
                               round=spec.round) from exc
        except Exception as exc:
            raise ReformFailed(f"rank {spec.rank} cannot re-form into round {spec.round}: "
                               f"{type(exc).__name__}: {exc}", round=spec.round) from exc
        timing.restored_at = time.time()
        timing.restored_step = self.step
        timing.host_bytes, timing.disk_bytes = self._restore_bytes
        timing.peer_bytes = self._peer_fill.held_bytes + self._peer_fill.pulled_bytes
        self.reforms.append(timing)
        self._first_step_pending = timing
        log.warning("rank %d round %d: re-formed at step %d in %.3fs (group %.3fs, engine %.3fs, restore %.3fs)",
                    self.rank, self.round, self.step, timing.restored_at - timing.started_at,
                    timing.group_up_at - timing.started_at, timing.engine_built_at - timing.group_up_at,
                    timing.restored_at - timing.engine_built_at)
        self.recorder.write("reform", step=self.step, round=spec.round, world_size=self.world_size, cause=cause,
                            timings=timing.to_json())
        self._tell_agent(spec.local_rank)
        return timing

    def _form(self, spec: ReformSpec, timing: ReformTimings, host: Any) -> Any:
        """Build the engine for the joined world, attach to it and restore (see :meth:`reform`)."""
        engine = self._recipe.build(self.config, spec.world_size)
        timing.engine_built_at = time.time()
        self._attach(engine, spec.round, spec.master_addr)
        self.round = spec.round
        return self._restore(required=True, host=host)

    def _join_newest(self, spec: ReformSpec) -> ReformSpec:
        """Join ``spec``'s world, or a newer one that the agent sends while its peers are still
        arriving (the round was superseded: nobody will complete it). Returns the spec joined."""
        joining = getattr(self.agent, "joining", None)
        while True:
            if callable(joining):
                joining(spec.round, 0, spec.world_size)
            try:
                join_world(spec, backend=backend_for_device(), collective_timeout_s=self.config.collective_timeout_s,
                           join_timeout_s=self.config.dist_timeout_s,
                           superseded=lambda r=spec.round: self._newer_reform(r),  # type: ignore[misc]
                           on_wait=(lambda n, w, r=spec.round: joining(r, n, w)) if callable(joining) else None)
                return spec
            except JoinSuperseded:
                spec = self._superseded_by_newer(spec, "joining")

    def _superseded_by_newer(self, spec: ReformSpec, while_: str) -> ReformSpec:
        """The newer round's spec that superseded ``spec`` (its Reform is waiting)."""
        newer = self._take_reform()
        assert newer is not None
        log.warning("rank %d: round %d superseded while %s; joining round %d as rank %d of %d",
                    spec.rank, spec.round, while_, newer.round, newer.rank, newer.world_size)
        self._check_world(newer)
        return newer

    def _drop_partial_world(self) -> None:
        """Leave a world that broke while it formed (nothing of it was trained on); never raises."""
        if self.engine is not None:
            _release_engine(self.engine, self.rank)
            self.engine = None
            try:
                self.checkpointer.close()  # the new world's: nothing saved yet
            except Exception as exc:  # noqa: BLE001 - a broken world may refuse a clean close
                log.warning("rank %d: closing the broken world's checkpointer: %s", self.rank, exc)
        self.state = None  # type: ignore[assignment]
        self._control = None
        world_sockets.cut()
        leave_world()

    def _await_newer_reform(self, spec: ReformSpec, cause: BaseException) -> ReformSpec:
        """The agent's Reform for a round after ``spec``'s, within ``reform_wait_s``; raises
        :class:`ReformFailed` without one, or ``SystemExit(0)`` on SIGTERM meanwhile."""
        deadline = time.monotonic() + self.config.reform_wait_s
        while not self._newer_reform(spec.round):
            if self._sigterm:
                raise SystemExit(0)
            if time.monotonic() > deadline:
                raise ReformFailed(f"rank {spec.rank} cannot re-form into round {spec.round}: it broke while it formed "
                                   f"({cause}) and no newer round came within {self.config.reform_wait_s:g}s",
                                   round=spec.round)
            time.sleep(0.05)
        newer = self._take_reform()
        assert newer is not None
        self._check_world(newer)
        return newer

    def _check_world(self, spec: ReformSpec) -> None:
        try:
            accumulation_steps(self.config.global_batch, self.config.micro_batch, spec.world_size)
        except TrainerError as exc:  # before joining: the peers would wait for this rank in vain
            raise ReformFailed(f"cannot re-form into round {spec.round}: {exc}", round=spec.round) from exc

    def _newer_reform(self, round_number: int) -> bool:
        with self._reform_lock:
            return self._reform_spec is not None and self._reform_spec.round > round_number

    def _leave(self) -> None:
        """Drop everything of the old world; never raises (the old world may be broken)."""
        self._leave_started = time.perf_counter()
        handle = self.checkpointer.inflight()  # the one save that may still be running
        if handle is not None and not handle.done() and not handle.wait_snapshot(5.0):
            log.warning("rank %d step %d: the snapshot of step %d did not finish", self.rank, self.step, handle.step)
        if handle is None or handle.done():
            self.checkpointer.close()
        else:
            # Its commit waits on a lost or hung peer (until that group's timeout): let it fail on
            # its own. It may have gathered every rank's part before the peer died, so forbid the
            # manifest now: after abandon() it is durable already or never will be, and the
            # restore below lists checkpoints only after every survivor got here.
            self.checkpointer.abandon()
            log.warning("rank %d step %d: abandoning the save of step %d in flight", self.rank, self.step,
                        handle.step)
        t0 = time.perf_counter()
        self._report_saves()
        _release_engine(self.engine, self.rank)
        self.engine = None
        self.state = None  # type: ignore[assignment]
        self._control = None
        t1 = time.perf_counter()
        leave_world()
        t2 = time.perf_counter()
        if torch.cuda.is_available():
            # The old engine is a web of reference cycles: only a full collection frees its device
            # memory before the new engine allocates its own (≈0.2 s). On the CPU its big tensors
            # are already freed by _release_engine; the rest waits for Python's own collection.
            gc.collect()
        log.info("rank %d: left the old world: save %.3fs, engine %.3fs, groups %.3fs, gc %.3fs", self.rank,
                 t0 - self._leave_started, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _tell_agent(self, local_rank: int) -> None:
        """Acknowledge the new round and rank to the agent (it kills a worker that does not)."""
        reformed = getattr(self.agent, "reformed", None)
        if callable(reformed):
            reformed(self.round, self.rank, local_rank)
