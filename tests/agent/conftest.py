"""Fixtures shared by the agent tests; makes their helpers importable from one another."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from stalwart.agent.config import AgentConfig
from stalwart.agent.node import NodeAgent

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


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
