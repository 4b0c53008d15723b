"""Progress reaches the local agent: a stand-in agent (the real gRPC Progress service on a unix
socket) receives each step with its loss and each committed checkpoint from examples/train_gpt.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_testlib import REPO, Direct, ProgressAgent, tail

pytestmark = pytest.mark.timeout(600)


def test_steps_and_checkpoints_are_reported_to_the_agent(ds_env: dict[str, str], tmp_path: Path) -> None:
    agent = ProgressAgent()
    with agent.serving(tmp_path / "agent.sock") as sock:
        jobs = Direct({**ds_env, "STALWART_AGENT_SOCKET": str(sock)})
        try:
            log = tmp_path / "run.log"
            rc = jobs.run(1, str(REPO / "examples" / "train_gpt.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
                          "--steps", "6", "--save-every", "3", log=log)
            assert rc == 0, tail(log)
            assert agent.closed.wait(30)
        finally:
            jobs.close()
    kinds = agent.said()
    assert [m.step.step for m in kinds["step"]] == [1, 2, 3, 4, 5, 6]
    assert all(m.step.loss > 0 and m.step.step_time > 0 for m in kinds["step"])
    assert [(m.checkpoint.step, m.checkpoint.committed) for m in kinds["checkpoint"]] == [(3, True), (6, True)]
    assert kinds["goodbye"][0].goodbye.reason == "finished"
