"""World sizes the trainer accepts: with the job's batch sizes (or an explicit ``world_sizes``)
in the policy, the pure round machine only opens rounds of node counts the trainer can train at,
and a policy that no node count satisfies is a one-line configuration error."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_rounds import Sim, only_round, rounds

from stalwart.daemon.config import ConfigError, load_config
from stalwart.daemon.policy import PolicyError, RoundPolicy
from stalwart.daemon.round_events import LeaseLost

# The example: global batch 1024, micro batch 4, 8 GPUs a node.
BATCH = {"global_batch": 1024, "micro_batch": 4, "workers_per_node": 8}
VALID = (1, 2, 4, 8, 16, 32)


def test_the_batch_sizes_allow_the_node_counts_that_split_the_global_batch() -> None:
    policy = RoundPolicy.from_mapping({"max_nodes": 64, **BATCH})
    assert policy.allowed_world_sizes == VALID
    assert [policy.world_size_for(n) for n in (0, 1, 3, 7, 12, 31, 33, 64)] == [None, 1, 2, 4, 8, 16, 32, 32]
    assert policy.largest_world_size == 32
    # an explicit list narrows it further; the quantum too
    narrowed = RoundPolicy(max_nodes=64, world_sizes=(2, 3, 8, 32), node_quantum=2, **BATCH)  # type: ignore[arg-type]
    assert narrowed.allowed_world_sizes == (2, 8, 32)


def test_rounds_open_only_at_allowed_node_counts_through_losses_and_regrows() -> None:
    sim = Sim(min_nodes=1, max_nodes=64, regrow_cooldown=0.0, **BATCH)
    first = sim.start(*[f"n{i:03d}" for i in range(12)])
    assert first.world_size == 8  # 12 registered: the largest allowed count
    sizes, fresh = [first.world_size], 12
    rng = random.Random(5)
    for _ in range(40):
        rnd = sim.machine.state.round
        if rnd is not None and rng.random() < 0.6:
            decisions = sim.send(LeaseLost(rng.choice(rnd.members)), 1.0)
        else:
            decisions = []
            for _ in range(rng.randint(1, 6)):
                decisions += sim.register(f"n{fresh:03d}")
                fresh += 1
            decisions += sim.tick(1.0)
        sizes += [r.world_size for r in rounds(decisions)]
    assert set(sizes) <= set(VALID)
    assert len(set(sizes)) >= 3  # the world did shrink and grow


def test_a_lost_member_shrinks_8_to_4_not_7() -> None:
    sim = Sim(min_nodes=1, max_nodes=64, **BATCH)
    first = sim.start(*[f"n{i}" for i in range(8)])
    assert first.world_size == 8
    shrunk = only_round(sim.send(LeaseLost("n3"), 1.0))
    assert shrunk.world_size == 4 and "n3" not in [m.node_id for m in shrunk.members]


@pytest.mark.parametrize("settings", [
    {"min_nodes": 3, "max_nodes": 3, **BATCH},  # 3 nodes x 8 does not divide 256 micro batches
    {"min_nodes": 33, "max_nodes": 64, **BATCH},  # 32 nodes is the most the batch splits over
    {"min_nodes": 1, "max_nodes": 8, "world_sizes": [12, 16]},
    {"min_nodes": 1, "max_nodes": 8, "world_sizes": [3], "node_quantum": 2},
    {"global_batch": 1024, "micro_batch": 4},  # workers_per_node missing
    {"global_batch": 1000, "micro_batch": 3, "workers_per_node": 1},
    {"world_sizes": [0, 2]},
])
def test_a_policy_no_node_count_satisfies_is_refused(settings: dict[str, object]) -> None:
    with pytest.raises(PolicyError):
        RoundPolicy.from_mapping(settings)


def test_the_config_error_names_the_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "daemon.toml"
    path.write_text('[daemon]\njob = "a"\n[policy]\nmin_nodes = 3\nmax_nodes = 3\n'
                    'global_batch = 1024\nmicro_batch = 4\nworkers_per_node = 8\n')
    with pytest.raises(ConfigError, match="no node count between min_nodes .3. and max_nodes .3."):
        load_config(path)
    from stalwart.cli.main import main

    assert main(["daemon", "--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "splits global_batch 1024" in err[0]
    assert main(["daemon", "--job", "a", "--world-sizes", "1,2,4", "--max-nodes", "4", "--check"]) == 0
    assert '"world_sizes": [\n' in capsys.readouterr().out
