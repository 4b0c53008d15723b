"""A warm spare's way into its first world.

A spare (``STALWART_SPARE=1``) builds its engine once while it waits, so that it joins a world as
fast as a survivor re-forms; :func:`join_as_spare` then waits for its assignment, joins that
round and builds the engine for it, or moves to the newer round that supersedes it (while it
joins or builds) or follows it when a lost peer breaks it while it forms.
:meth:`Trainer.initialize <stalwart.trainer.Trainer.initialize>` calls it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from stalwart.proto.contract import ENV_SPARE
from stalwart.trainer.agent_client import AgentClient
from stalwart.trainer.config import TrainerConfig
from stalwart.trainer.engine import _EngineRecipe, _release_engine, _warm_up
from stalwart.trainer.errors import ReformFailed
from stalwart.trainer.reform import (
    JoinSuperseded,
    ReformSpec,
    is_collective_error,
    join_world,
    leave_world,
    within_round,
)
from stalwart.trainer.world_sockets import world_sockets

log = logging.getLogger(__name__)


def join_as_spare(agent: AgentClient, assignment: Callable[[], ReformSpec] | None, recipe: _EngineRecipe,
                  config: TrainerConfig, backend: str, *, warm: bool) -> tuple[ReformSpec, Any]:
    """Warm up (where ``warm``), wait for the assignment (``assignment()`` where given, else the
    agent client's ``wait_for_assignment()``), join its world and build the engine for it.
    Returns the spec of the round joined and its engine."""
    source = assignment or getattr(agent, "wait_for_assignment", None)
    if source is None:
        raise ReformFailed("a spare (STALWART_SPARE=1) needs an assignment: the agent client's "
                           "wait_for_assignment or Trainer.initialize(assignment=...)")
    started = time.perf_counter()
    if warm:
        _warm_up(recipe, config, backend)
    log.info("spare pid %d: model built, engine warmed up in %.2fs, waiting for an assignment",
             os.getpid(), time.perf_counter() - started)
    spec = source()
    log.warning("spare pid %d: assigned rank %d of %d in round %d", os.getpid(), spec.rank,
                spec.world_size, spec.round)
    os.environ.pop(ENV_SPARE, None)
    has_newer = getattr(agent, "has_newer_reform", lambda _round: False)
    while True:
        spec = _join(agent, spec, config, backend)
        try:
            engine = within_round(spec.round, lambda r=spec.round: has_newer(r),  # type: ignore[misc]
                                  lambda s=spec: recipe.build(config, s.world_size))  # type: ignore[misc]
            return spec, engine
        except JoinSuperseded as exc:
            # Superseded after the join, while DeepSpeed made its groups (a peer lost meanwhile
            # would hold this process in new_group): leave that world for the newer round.
            if exc.built is not None:
                _release_engine(exc.built, spec.rank)
            leave_world()
            newer = agent.take_newer_reform(spec.round)
            assert newer is not None
            log.warning("spare pid %d: round %d superseded while its engine was built; joining round %d as rank %d",
                        os.getpid(), spec.round, newer.round, newer.rank)
            spec = newer


def _join(agent: AgentClient, spec: ReformSpec, config: TrainerConfig, backend: str) -> ReformSpec:
    """Join ``spec``'s world, or the newer one that supersedes it or follows it when a lost peer
    breaks it while it forms. Returns the spec of the round joined."""
    has_newer = getattr(agent, "has_newer_reform", lambda _round: False)
    joining = getattr(agent, "joining", None)
    while True:
        if callable(joining):
            joining(spec.round, 0, spec.world_size)
        try:
            join_world(spec, backend=backend, collective_timeout_s=config.collective_timeout_s,
                       join_timeout_s=config.dist_timeout_s,
                       superseded=lambda r=spec.round: has_newer(r),  # type: ignore[misc]
                       on_wait=(lambda n, w, r=spec.round: joining(r, n, w)) if callable(joining) else None)
            return spec
        except JoinSuperseded:
            newer = agent.take_newer_reform(spec.round)
            assert newer is not None
            log.warning("spare pid %d: round %d superseded while joining; joining round %d as rank %d",
                        os.getpid(), spec.round, newer.round, newer.rank)
            spec = newer
        except Exception as exc:
            newer = _newer_after_broken_join(agent, spec, exc, config.reform_wait_s)
            if newer is None:
                raise ReformFailed(f"spare cannot join round {spec.round}: {exc}", round=spec.round) from exc
            spec = newer


def _newer_after_broken_join(agent: Any, spec: ReformSpec, exc: BaseException, wait_s: float) -> ReformSpec | None:
    """A spare's join that a lost peer broke (its store host died, a connection was reset): the
    round is lost, not the spare. Leave what formed and return the agent's next Reform, within
    ``wait_s``; None when the error is not that (a timeout, a bad spec) or no newer round comes."""
    text = str(exc).lower()
    if not is_collective_error(exc) or "timed out" in text or "timeout" in text:
        return None
    take = getattr(agent, "take_newer_reform", None)
    if take is None:
        return None
    log.error("spare pid %d: round %d broke while it formed (%s); waiting for the next round", os.getpid(),
              spec.round, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    world_sockets.cut()
    leave_world()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        newer = take(spec.round)
        if newer is not None:
            return newer
        time.sleep(0.05)
    return None
