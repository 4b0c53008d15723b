"""Makes the daemon test helpers (``daemon_testlib``) importable; a factory of simulated agents."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from daemon_testlib import SimAgent  # noqa: E402

from stalwart.coord.client import EtcdClient  # noqa: E402


@pytest.fixture
def make_agent(etcd_client: EtcdClient) -> Iterator[Callable[[str, str], SimAgent]]:
    """``make_agent(job, node)``: an unregistered simulated agent, stopped at teardown."""
    made: list[SimAgent] = []

    def make(job: str, node: str) -> SimAgent:
        agent = SimAgent(etcd_client, job, node)
        made.append(agent)
        return agent

    try:
        yield make
    finally:
        for agent in made:
            agent.close()
