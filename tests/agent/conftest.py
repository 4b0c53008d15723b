"""Fixtures shared by the agent tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from stalwart.agent.config import AgentConfig
from stalwart.agent.node import NodeAgent


@pytest.fixture
def start_agent() -> Iterator[Callable[[AgentConfig], NodeAgent]]:
    agents: list[tuple[NodeAgent, threading.Thread]] = []

    def start(config: AgentConfig) -> NodeAgent:
        agent = NodeAgent(config)
        agent.start()
        thread = threading.Thread(target=agent.run, daemon=True)  # lives as long as the workers
        thread.start()
        agents.append((agent, thread))
        return agent

    yield start
    for agent, thread in agents:
        agent.shutdown()
        thread.join(timeout=15)
