"""What the replica heads count of the requests they served, read from their /metrics as nginx
reaches them (from the load-balancer node): vLLM's own counters (labkit/models/servermetrics.py), which
the stand-in exposes too, so that `check` counts the same way on both engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from labkit.cluster import probes
from labkit.cluster.blueprint import LabPlan
from labkit.hosts import netns
from labkit.models import servermetrics


@dataclass(frozen=True)
class Served:
    """What one replica head's /metrics counts (labkit/models/servermetrics.py), as vLLM exposes it and
    the stand-in likewise; None where the server has no such metric."""

    handlers: dict[tuple[str, str], float] | None  # http_requests_total by (method, handler)
    finished: float | None  # vllm:request_success_total
    with_authorization: float | None  # the stand-in's own; vLLM counts no such thing

    @property
    def requests(self) -> float | None:
        return None if self.handlers is None else sum(self.handlers.values())

    @property
    def stand_in(self) -> bool:
        """The lab's stand-in (labkit/models/modelserver.py): the one server that counts these."""
        return self.with_authorization is not None


def read(plan: LabPlan) -> dict[str, Served]:
    """Each replica head's counters, asked from the load-balancer node, as nginx reaches them."""
    counts = {}
    for head in plan.heads:
        # A real server busy with a disaggregated request took over 5 s to answer /metrics on
        # this 2-core machine (its row said "not counted").
        reply = netns.call_in(
            plan.load_balancer.namespace, probes.get, head.ip, plan.cluster.model_port, "/metrics", timeout=30
        )
        text = reply.body.decode(errors="replace") if reply.ok else ""
        counts[head.node] = Served(
            servermetrics.by_handler(text),
            servermetrics.total(text, servermetrics.SUCCESS),
            servermetrics.total(text, "lab_requests_with_authorization_total"),
        )
    return counts


def delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def reached(before: dict[str, Served], after: dict[str, Served]) -> float | None:
    """Requests the model servers counted in http_requests_total between two readings; None
    when one of them does not count."""
    deltas = [delta(before[node].requests, after[node].requests) for node in before]
    return None if any(d is None for d in deltas) else sum(deltas)


def leaked(before: dict[str, Served], after: dict[str, Served]) -> dict[str, float]:
    """The counted requests between two readings, by `METHOD handler`."""
    found: dict[str, float] = {}
    for node, then in before.items():
        for key, value in (after[node].handlers or {}).items():
            grown = value - (then.handlers or {}).get(key, 0.0)
            if grown:
                found[" ".join(key)] = found.get(" ".join(key), 0.0) + grown
    return found


SETTLE_SECONDS = 2.0


def settled(plan: LabPlan, before: dict[str, Served], want: float) -> float | None:
    """Requests counted since `before`, read again for a moment while fewer than `want`: vLLM
    counts a request once its answer has gone out (the instrumentator's `finally`)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        count = reached(before, read(plan))
        if count is None or count >= want or time.monotonic() >= deadline:
            return count
        time.sleep(0.1)


def handler_settled(plan: LabPlan, before: dict[str, Served], method: str, path: str, want: float) -> float:
    """How often the servers counted `method path` since `before`, read again for a moment while
    fewer than `want` (as `settled`)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        count = leaked(before, read(plan)).get(f"{method} {path}", 0.0)
        if count >= want or time.monotonic() >= deadline:
            return count
        time.sleep(0.1)


def counted(count: float | None) -> str:
    return "not counted (no http_requests_total)" if count is None else f"{count:g}"
