"""The agent's Prometheus metrics, in a registry of its own (several agents can share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from stalwart.agent.service import BindError


class AgentMetrics:
    def __init__(self, node: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"node": node}
        self.steps = Counter("stalwart_agent_steps", "Training steps completed, per worker (rate() = step rate)",
                             ["node", "rank"], registry=self.registry)
        self.last_step = Gauge("stalwart_agent_last_step", "Last step completed, per worker", ["node", "rank"],
                               registry=self.registry)
        self.step_seconds = Gauge("stalwart_agent_step_seconds", "Duration of the last step, per worker",
                                  ["node", "rank"], registry=self.registry)
        self.step_time = Gauge("stalwart_agent_last_step_timestamp_seconds", "Unix time of the last step completed, "
                               "per worker (time() minus this, over step seconds: steps overdue)", ["node", "rank"],
                               registry=self.registry)
        self.stalls = Counter("stalwart_agent_stalls", "Workers declared stalled", ["node"], registry=self.registry)
        self.faults = Counter("stalwart_agent_faults", "Faults seen, by kind (worker exits, GPU findings, injected)",
                              ["node", "kind"], registry=self.registry)
        self.restarts = Counter("stalwart_agent_worker_starts", "Worker groups started (one per round joined)",
                                ["node"], registry=self.registry)
        self.checkpoint_time = Gauge("stalwart_agent_last_checkpoint_timestamp_seconds",
                                     "Unix time of the last committed checkpoint reported by a worker "
                                     "(time() minus this is the checkpoint age)", ["node"], registry=self.registry)
        self.findings = Gauge("stalwart_agent_health_findings", "Current health findings, by code and severity",
                              ["node", "code", "severity"], registry=self.registry)
        self.round = Gauge("stalwart_agent_round", "Round this node's workers run in (0: none)", ["node"],
                           registry=self.registry)
        self.reforms = Counter("stalwart_agent_reforms", "In-place re-forms of workers, by outcome (sent, "
                               "acknowledged, timed-out, undeliverable)", ["node", "outcome"], registry=self.registry)
        self.reform_seconds = Gauge("stalwart_agent_last_reform_seconds",
                                    "Seconds from sending the last acknowledged re-form to its acknowledgement",
                                    ["node"], registry=self.registry)
        self.spares = Gauge("stalwart_agent_spares", "Warm spare processes, by state (ready, starting)",
                            ["node", "state"], registry=self.registry)
        self.spare_assignments = Counter("stalwart_agent_spare_assignments", "Warm spares that took a local rank",
                                         ["node"], registry=self.registry)
        self.badput = Counter("stalwart_badput_seconds", "Training time lost on this node, by cause: startup "
                              "(start to first step), re-form (a Reform to the first step after it), pause (a gap "
                              "of more than two normal steps)", ["node", "cause"], registry=self.registry)
        self._node = node
        for cause in ("startup", "re-form", "pause"):
            self.badput.labels(node, cause)
        for state in ("ready", "starting"):
            self.spares.labels(node, state).set(0)
        self.spare_assignments.labels(**labels)
        for kind in ("worker-signal", "worker-user-error", "worker-oom-killed"):
            self.faults.labels(node, kind)  # the common kinds, zero from the start (alerts need a series)
        for counter in (self.stalls, self.restarts):
            counter.labels(**labels)  # export zero from the start

    def step(self, rank: int, step: int, step_time: float) -> None:
        r = str(rank)
        self.steps.labels(self._node, r).inc()
        self.last_step.labels(self._node, r).set(step)
        self.step_seconds.labels(self._node, r).set(step_time)
        self.step_time.labels(self._node, r).set_to_current_time()

    def set_findings(self, findings: list[tuple[str, str]]) -> None:
        self.findings.clear()
        for code, severity in findings:
            self.findings.labels(self._node, code, severity).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port); returns the bound port.
        Raises :class:`BindError` when the address cannot be bound."""
        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise BindError(f"metrics_port: cannot bind {addr}:{port}: {exc.strerror or exc}") from None
        return int(server.server_address[1])
