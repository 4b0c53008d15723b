"""The run's check that no corrupted checkpoint was loaded, on the records a run writes."""

from __future__ import annotations

from types import SimpleNamespace

from stalwart.chaos.runner import _Run


def _losses(events: list[dict], corrupted: dict[int, float]) -> tuple[int, int]:
    run = SimpleNamespace(events=events, corrupted=corrupted, t0=0.0)
    return _Run._losses_of_restores(run)  # type: ignore[arg-type]


def test_a_rollback_to_a_corrupted_step_counts_only_if_it_read_from_storage() -> None:
    """Step 150 was corrupted on disk at t=5; a rollback to it that took every byte from memory
    (its own host copy and peer replicas) loaded nothing corrupt, one that read storage did."""
    base = [{"event": "commit", "t": 1.0, "step": 150}]
    from_memory = {"event": "rollback", "t": 6.0, "step": 150, "world_host_bytes": 10, "world_peer_bytes": 10,
                   "world_disk_bytes": 0}
    from_disk = dict(from_memory, world_disk_bytes=5)
    assert _losses([*base, from_memory], {150: 5.0}) == (0, 0)
    assert _losses([*base, from_disk], {150: 5.0}) == (0, 1)
    assert _losses([*base, {**from_disk, "t": 4.0}], {150: 5.0}) == (0, 0)  # before the byte was flipped
    # a record that does not say where its bytes came from is counted, as the worst case
    assert _losses([*base, {"event": "rollback", "t": 6.0, "step": 150}], {150: 5.0}) == (0, 1)
