"""The agent-trainer contract: what the agent sets and reads is what the trainer reads and sets."""

from __future__ import annotations

import stalwart.trainer
from stalwart.agent.workers import ExitKind, RoundAssignment, classify
from stalwart.proto import contract
from stalwart.trainer.reform import ReformSpec, is_spare


def test_a_workers_environment_from_the_agent_reads_back_in_the_trainer() -> None:
    assignment = RoundAssignment(round=7, group_rank=1, first_rank=2, local_world_size=2, world_size=4,
                                 master_addr="10.0.0.1", master_port=29500, restore_step=30)
    env = assignment.env(local_rank=1)
    assert ReformSpec.from_env(env) == ReformSpec(rank=3, world_size=4, master_addr="10.0.0.1", master_port=29500,
                                                  round=7, local_rank=1)
    assert env[contract.ENV_RESTORE_STEP] == "30"
    assert ReformSpec.from_env(env).env()[contract.ENV_ROUND] == "7"  # a re-formed worker's round, same name


def test_spare_marker_and_give_up_status_mean_the_same_on_both_sides() -> None:
    assert is_spare({contract.ENV_SPARE: "1"}) and not is_spare({})
    assert stalwart.trainer.EXIT_DIVERGED == contract.EXIT_DIVERGED
    assert classify(contract.EXIT_DIVERGED, stopping=False, oom_before=0)[0] is ExitKind.GAVE_UP


def test_the_socket_is_private_and_dialled_as_a_unix_target() -> None:
    assert contract.SOCKET_MODE & 0o077 == 0 and contract.SOCKET_DIR_MODE & 0o077 == 0
    assert contract.socket_target("/run/stalwart/agent.sock") == "unix:/run/stalwart/agent.sock"
