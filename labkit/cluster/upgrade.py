"""`lab.py upgrade`: apply a changed stack config to a running lab while clients use it.

Three watchers run while the executor applies the change (lifecycle.apply):
- `ClientLoad`: bounded requests through nginx from the lab's client namespace (at most
  `max_requests`, at `rate` per second; every `stream_every`-th one streamed), only to the
  load balancer's lab address;
- `ReplicaWatch`: every replica head's /health, asked from the load-balancer node as nginx
  would, every `interval` seconds: the most replicas down at one moment;
- `ProbeWatch` (optional): the probes that must stay closed both before and after the change,
  swept again and again: any of them seen open is reported.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from labkit.cluster import blueprint, lifecycle, probes
from labkit.cluster.blueprint import LabPlan, ProbeExpectation
from labkit.engine import executor
from labkit.hosts import netns
from qwen_cluster.ports import Vantage
from qwen_cluster.render import rollout
from qwen_cluster.render.vllm import HEALTH_PATH
from tooling import changes as change_syntax
from tooling.changes.impact import DRAIN_SUFFIXES, HEALTH_GATE_SUFFIXES


class UpgradeError(RuntimeError):
    pass


@dataclass
class LoadSettings:
    max_requests: int = 300
    rate: float = 8.0  # requests per second, all workers together
    workers: int = 4
    stream_every: int = 3  # every third request is streamed
    stream_tokens: int = 20
    stream_token_delay: float = 0.05  # a streamed answer lasts about a second
    chat_tokens: int | None = None  # max_tokens of the plain requests (None: the server's default)
    access: probes.ClientAccess | None = None  # None: the lab's own key (lifecycle.client_access)
    request_timeout: float = 60.0  # seconds one request may take (a disaggregated lab's take longer)


def pd_real_model_load(max_requests: int) -> LoadSettings:
    """The client load against a disaggregated stack on the real vLLM: a request took 14-45 s on
    two cores (check.PD_REQUEST_SECONDS), so two clients, one request every 4 s at most, and the
    timeout to match."""
    from labkit.cluster import check

    return LoadSettings(
        max_requests=max_requests,
        rate=0.25,
        workers=2,
        stream_every=3,
        stream_tokens=8,
        chat_tokens=8,
        request_timeout=check.PD_REQUEST_SECONDS,
    )


def real_model_load(max_requests: int) -> LoadSettings:
    """The client load against the real vLLM (`--real-model`): it writes ~250 tokens/s on a quiet
    machine shared by every request, and a random model may not stop before its context is full,
    so fewer requests, each with a token cap."""
    return LoadSettings(max_requests=max_requests, rate=2.0, workers=4, stream_tokens=16, chat_tokens=16)


@dataclass
class Outcome:
    streamed: bool
    ok: bool
    cut: bool
    status: int
    node: str | None
    image: str | None
    started: float
    seconds: float
    error: str | None


class ClientLoad:
    """Requests through the load balancer from the client namespace until stopped or capped."""

    def __init__(self, lab_plan: LabPlan, settings: LoadSettings):
        self.settings = settings
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self._tickets = itertools.count()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.ip = lab_plan.load_balancer.ip
        self.port = lab_plan.cluster.load_balancer.port
        # The lab's key over TLS from its CA, unless the test says otherwise (a key rotation).
        self.access = settings.access or lifecycle.client_access(lab_plan)
        client = lab_plan.vantage(Vantage.CLIENT).namespace
        self.threads = [
            threading.Thread(target=netns.call_in, args=(client, self._worker), daemon=True)
            for _ in range(settings.workers)
        ]

    def _worker(self) -> None:
        while not self.stop.is_set():
            ticket = next(self._tickets)
            if ticket >= self.settings.max_requests:
                return
            due = self._t0 + ticket / self.settings.rate
            while not self.stop.is_set() and time.monotonic() < due:
                time.sleep(min(0.05, max(0.0, due - time.monotonic())))
            if self.stop.is_set():
                return
            started = time.monotonic() - self._t0
            if ticket % self.settings.stream_every == self.settings.stream_every - 1:
                seen = probes.stream(
                    self.ip,
                    self.port,
                    f"upgrade {ticket}",
                    timeout=self.settings.request_timeout,
                    headers={"X-Lab-Token-Delay": f"{self.settings.stream_token_delay}"},
                    max_tokens=self.settings.stream_tokens,
                    access=self.access,
                )
                began = seen.status == 200
                outcome = Outcome(
                    True,
                    seen.ok,
                    began and not seen.ok,
                    seen.status,
                    seen.node,
                    seen.image,
                    started,
                    time.monotonic() - self._t0 - started,
                    seen.error,
                )
            else:
                reply = probes.chat(
                    self.ip,
                    self.port,
                    f"upgrade {ticket}",
                    timeout=self.settings.request_timeout,
                    max_tokens=self.settings.chat_tokens,
                    access=self.access,
                )
                outcome = Outcome(
                    False,
                    reply.ok,
                    False,
                    reply.status,
                    reply.node,
                    reply.image,
                    started,
                    reply.seconds,
                    reply.error,
                )
            with self._lock:
                self.outcomes.append(outcome)

    def __enter__(self) -> ClientLoad:
        self._t0 = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)


PROBE_SECONDS = float(rollout.HEALTH_CONNECT_SECONDS)


class ReplicaWatch:
    """Which replica heads answer /health, sampled from the load-balancer node. A head is down
    when it does not answer 200 within the time the program's own health gate gives one probe
    (rollout.HEALTH_CONNECT_SECONDS): refused, failing or silent that long. A slower answer is
    not an outage: with a fixed 0.5 s, a real vLLM answering late on a saturated 2-core machine
    (its peer loading beside it) was counted down, and a bump with one replica out at a time
    reported two."""

    def __init__(self, lab_plan: LabPlan, heads: list[tuple[str, str]], interval: float = 0.1):
        self.heads = heads  # (node, ip)
        self.port = lab_plan.cluster.model_port
        self.namespace = lab_plan.load_balancer.namespace
        self.interval = interval
        self.stop = threading.Event()
        self.max_down = 0
        self.down_at_max: list[str] = []
        self.samples = 0
        self.thread = threading.Thread(target=netns.call_in, args=(self.namespace, self._watch), daemon=True)

    def _watch(self) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(self.heads))) as pool:
            while not self.stop.is_set():
                answers = list(
                    pool.map(
                        lambda head: (
                            netns.call_in(
                                self.namespace, probes.get, head[1], self.port, HEALTH_PATH,
                                timeout=PROBE_SECONDS,
                            )
                        ),
                        self.heads,
                    )
                )
                # Each down head with why (its status, or the error: refused, or no answer within
                # the probe's time), so that a report tells an outage from a slow /health.
                down = [
                    f"{head[0]} ({reply.status or (reply.error or '').split(':')[0]})"
                    for head, reply in zip(self.heads, answers, strict=True)
                    if reply.status != 200
                ]
                self.samples += 1
                if len(down) > self.max_down:
                    self.max_down, self.down_at_max = len(down), down
                self.stop.wait(self.interval)

    def __enter__(self) -> ReplicaWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def must_stay_closed(before: LabPlan, after: LabPlan) -> list[ProbeExpectation]:
    """Probes closed in both plans, between members both plans have: whatever the change does,
    none of these may ever connect. (A node that joins is open until its firewall step runs,
    as a fresh host is; a node that leaves stops mattering.)"""

    def key(exp: ProbeExpectation) -> tuple:
        return exp.vantage, exp.target_node, exp.target_ip, exp.port

    closed_after = {key(exp) for exp in after.expectations() if not exp.open}
    common = {m.namespace for m in before.members} & {m.namespace for m in after.members}
    return [
        exp
        for exp in before.expectations()
        if not exp.open and exp.source in common and key(exp) in closed_after
    ]


class ProbeWatch:
    """Sweeps of the must-stay-closed probes until stopped; any connection is a violation."""

    def __init__(self, expectations: list[ProbeExpectation], timeout: float = 0.3, workers: int = 24):
        self.expectations = expectations
        self.timeout = timeout
        self.workers = workers
        self.stop = threading.Event()
        self.sweeps = 0
        self.opened: list[str] = []
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _probe(self, exp: ProbeExpectation) -> None:
        if netns.call_in(exp.source, probes.tcp_connect, exp.target_ip, exp.port, self.timeout).open:
            self.opened.append(f"{exp.vantage} -> {exp.target_node} {exp.name} {exp.port}/tcp")

    def _watch(self) -> None:
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            while not self.stop.is_set():
                list(pool.map(self._probe, self.expectations))
                self.sweeps += 1

    def __enter__(self) -> ProbeWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@dataclass
class UpgradeReport:
    requests: int
    failed: int
    streams_cut: int
    max_replicas_down: int
    seconds: float
    steps: list[executor.StepResult]
    ok: bool
    notes: list[str] = field(default_factory=list)
    down_at_max: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    images: dict[str, str] = field(default_factory=dict)  # the image each replica runs afterwards
    probe_sweeps: int | None = None
    opened: list[str] = field(default_factory=list)  # must-stay-closed probes seen open
    # Where a failed rollout stopped: the failed steps, and the replicas no step reached (they
    # still run what they ran before).
    stopped_at: list[str] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # drained, their gate never passed
    lanes: list[list[str]] = field(default_factory=list)  # replica heads, lane by lane

    def as_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "requests": self.requests,
            "failed": self.failed,
            "streamsCut": self.streams_cut,
            "maxReplicasDown": self.max_replicas_down,
            "replicasDownAtMax": self.down_at_max,
            "seconds": round(self.seconds, 2),
            "steps": [
                {
                    "resource": step.resource,
                    "op": step.op,
                    "node": step.node,
                    "ok": step.ok,
                    "at": step.started,
                    "seconds": step.seconds,
                    **({} if step.ok else {"detail": step.detail[-500:]}),
                }
                for step in self.steps
            ],
            "ok": self.ok,
            "lanes": self.lanes,
        }
        if not self.ok:
            document["stoppedAt"] = self.stopped_at
            document["replicasNotReached"] = self.not_reached
            document["replicasLeftOut"] = self.left_out
        if self.probe_sweeps is not None:
            document["probes"] = {"sweeps": self.probe_sweeps, "openThatMustBeClosed": self.opened}
        return document


def changed_config(label: str, changes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config last applied to the lab, that config with --change applied)."""
    state = executor.load_state(lifecycle.state_file_for(label))
    if state is None:
        raise UpgradeError(f"lab {label} is not up (no applied state): run `lab.py up` first")
    try:
        return state.config, change_syntax.apply_changes(state.config, changes)
    except change_syntax.ChangeSyntaxError as error:
        raise UpgradeError(str(error)) from error


def run(
    label: str,
    changes: list[str],
    options: lifecycle.Options,
    *,
    load: LoadSettings | None = None,
    probe_matrix: bool = False,
) -> UpgradeReport:
    """Apply `changes` (KEY=VALUE, as plan.py --change) to the running lab `label` under load."""
    old_config, new_config = changed_config(label, changes)
    before = blueprint.from_stack_config(old_config, label)
    after = blueprint.from_stack_config(new_config, label)  # ConfigError names the key and value
    load = load or LoadSettings()
    if options.real_model and before.cluster.disaggregated:
        load = pd_real_model_load(load.max_requests)
    kept = {m.node for m in before.heads} & {m.node for m in after.heads}
    heads = [(m.node, m.ip) for m in before.heads if m.node in kept]
    watch_probes = ProbeWatch(must_stay_closed(before, after)) if probe_matrix else None
    started = time.monotonic()
    with ReplicaWatch(before, heads) as replicas, ClientLoad(before, load) as clients:
        if watch_probes is not None:
            watch_probes.__enter__()
        try:
            time.sleep(0.3)  # the load is flowing before anything changes
            report = lifecycle.apply(after, options, config=new_config)
            time.sleep(0.3)
        finally:
            if watch_probes is not None:
                watch_probes.__exit__()
    seconds = time.monotonic() - started
    outcomes = clients.outcomes
    failures = [
        f"{'stream' if o.streamed else 'chat'} at {o.started:.2f} s: {o.error or f'HTTP {o.status}'}"
        for o in outcomes
        if not o.ok
    ]
    # Which version each replica runs now, asked from the load-balancer node.
    images = {
        head.node: netns.call_in(
            after.load_balancer.namespace, probes.get, head.ip, after.cluster.model_port, HEALTH_PATH
        ).image
        or ""
        for head in after.heads
    }
    opened = sorted(set(watch_probes.opened)) if watch_probes else []
    ran = [step for step in report.steps if step.op not in ("fixture", "same")]
    stopped_at = [
        f"{step.resource or step.step} on {step.node}: {_last_line(step.detail)}"
        for step in ran
        if not step.ok
    ]
    # A replica is reached when its rollout began: its drain ran (components/baremetal/rollout.py).
    drained = {step.resource for step in ran}
    not_reached = [
        head.node
        for head in after.heads
        if not any(f"{head.node}{suffix}" in drained for suffix in DRAIN_SUFFIXES)
    ]
    # Out of the load balancer when the rollout stopped: drained, and their gate did not pass
    # (it failed, or never started because the engine stopped starting steps).
    passed = {step.resource for step in ran if step.ok}
    left_out = [
        head.node
        for head in after.heads
        if head.node not in not_reached
        and not any(f"{head.node}{suffix}" in passed for suffix in HEALTH_GATE_SUFFIXES)
    ]
    return UpgradeReport(
        requests=len(outcomes),
        failed=sum(1 for o in outcomes if not o.ok and not o.cut),
        streams_cut=sum(1 for o in outcomes if o.cut),
        max_replicas_down=replicas.max_down,
        seconds=seconds,
        steps=[step for step in report.steps if step.op not in ("fixture", "same")],
        ok=report.ok and not opened,
        notes=report.notes,
        down_at_max=replicas.down_at_max,
        failures=failures,
        images=images,
        probe_sweeps=watch_probes.sweeps if watch_probes else None,
        opened=opened,
        stopped_at=stopped_at,
        not_reached=not_reached if stopped_at else [],
        left_out=left_out if stopped_at else [],
        lanes=[[replica.head.name for replica in lane] for lane in after.cluster.rollout_lanes],
    )


def _last_line(detail: str) -> str:
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
