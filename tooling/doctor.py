"""doctor: the guide's troubleshooting (telnet a port, ping, route -n) as one command.

    scripts/doctor.py STACK [--lab] [--json] [--prometheus URL]

Asks the cluster's Prometheus what it sees (the alert rules rendered from the stack config)
and prints each problem with where it is, its likely cause and what to check, in the guide's
terms: a firewall port closed between two nodes, latency over the budget, a replica down, a
NIC below the bandwidth floor.

Which Prometheus: `--prometheus URL`; with `--lab`, the lab's (inside the lab's namespaces);
otherwise the stack's `prometheus` output (`pulumi stack output`, when the CLI is there), else
the address the stack config gives it (monitoring.node and the `prometheus` port row, the
same value the output holds).

Exit 0 healthy, 1 with findings, 2 when Prometheus cannot be asked.
`--json` prints {"healthy": bool, "prometheus": url, "findings": [{"severity", "what",
"where", "cause", "fix"}]}; `where` lists the node names.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from qwen_cluster.config import ClusterConfig, ConfigError
from qwen_cluster.render.monitoring import alerts, prometheus
from tooling import stackfile

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


class Unreachable(Exception):
    """Prometheus did not answer, or not with its API."""


@dataclass
class Finding:
    severity: str
    what: str
    where: list[str]
    cause: str
    fix: str
    alert: str = ""  # the alert behind it (not in the JSON: its shape is the issue's)

    def as_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "alert"}


Fetch = Callable[[str], Any]  # API path -> the decoded `data` of the answer


def http_fetch(base: str, timeout: float = 5.0) -> Fetch:
    def fetch(path: str) -> Any:
        url = base.rstrip("/") + path
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise Unreachable(f"{url}: HTTP {error.code}") from None
        except (OSError, ValueError) as error:
            raise Unreachable(f"{url}: {error}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise Unreachable(f"{url}: not a Prometheus API answer")
        return body.get("data")

    return fetch


def _where(alert: alerts.Alert | None, labels: dict[str, str], cluster: ClusterConfig) -> list[str]:
    names = {node.name for node in cluster.nodes}
    keys = alert.where if alert is not None else ("node",)
    found = [labels[key] for key in keys if labels.get(key) in names]
    if alert is not None and not alert.where:  # cluster-wide: every replica head
        found = [head.name for head in cluster.topology.heads]
    return list(dict.fromkeys(found))


def findings(fetch: Fetch, cluster: ClusterConfig) -> list[Finding]:
    """What is wrong now: alerts firing, and rules that are not loaded or fail."""
    known = {alert.name: alert for alert in alerts.alerts(cluster)}
    result: list[Finding] = []
    groups = (fetch("/api/v1/rules") or {}).get("groups", [])
    loaded = {}
    for group in groups:
        for rule in group.get("rules", []):
            if rule.get("type") == "alerting":
                loaded[rule.get("name")] = rule
    missing = sorted(set(known) - set(loaded))
    if missing:
        result.append(
            Finding(
                "critical",
                f"Prometheus has not loaded the alert rules {', '.join(missing)}",
                [cluster.monitoring_node.name] if cluster.monitoring_node else [],
                "its rule file is not the one rendered for this stack, or a reload failed",
                "promtool check rules on the rule file; docker logs qwen-prometheus",
            )
        )
    for name, rule in sorted(loaded.items()):
        if rule.get("health") not in (None, "ok", "unknown"):
            result.append(
                Finding(
                    "warning",
                    f"rule {name} does not evaluate: {rule.get('lastError', '')}",
                    [],
                    "a query error (a changed metric name, a bad expression)",
                    "promtool check rules; query the expression in Prometheus's UI",
                )
            )
    for item in (fetch("/api/v1/alerts") or {}).get("alerts", []):
        if item.get("state") != "firing":
            continue
        labels = item.get("labels", {})
        annotations = item.get("annotations", {})
        alert = known.get(labels.get("alertname", ""))
        result.append(
            Finding(
                labels.get("severity", "warning"),
                annotations.get("summary") or labels.get("alertname", "an alert"),
                _where(alert, labels, cluster),
                annotations.get("cause", ""),
                annotations.get("fix", ""),
                labels.get("alertname", ""),
            )
        )
    result.sort(key=lambda f: (SEVERITY_ORDER.get(f.severity, 9), f.what))
    return result


def stack_output_url(stack: str) -> str | None:
    """The `prometheus` stack output, when the Pulumi CLI can tell it."""
    if shutil.which("pulumi") is None:
        return None
    try:
        done = subprocess.run(
            ["pulumi", "stack", "output", "prometheus", "--stack", stack],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    url = done.stdout.strip()
    return url if done.returncode == 0 and url.startswith("http") else None


def configured_url(cluster: ClusterConfig) -> str | None:
    where = cluster.monitoring_node
    if where is None:
        return None
    return f"http://{where.ip}:{prometheus.prometheus_port(cluster)}"


def print_human(stack: str, url: str, found: list[Finding]) -> None:
    if not found:
        print(f"doctor {stack}: healthy ({url}: every rule loaded, no alert firing)")
        return
    print(f"doctor {stack}: {len(found)} finding{'s' if len(found) != 1 else ''} ({url})")
    for finding in found:
        print(f"\n[{finding.severity}] {finding.what}")
        if finding.where:
            print(f"  where: {', '.join(finding.where)}")
        if finding.cause:
            print(f"  cause: {finding.cause}")
        if finding.fix:
            print(f"  check: {finding.fix}")


# The lab's Prometheus, reached inside the lab: labkit/doctor.py passes it (the tooling never
# imports the lab; scripts/doctor.py goes through labkit).
LabFetch = Callable[[str, str | None], tuple[Fetch, str]]


def main(argv: list[str] | None = None, lab_fetch: LabFetch | None = None) -> int:
    parser = argparse.ArgumentParser(prog="doctor.py", description=__doc__.splitlines()[0])
    parser.add_argument("stack", help="a stack name (Pulumi.<stack>.yaml)")
    parser.add_argument("--lab", action="store_true", help="ask the lab's Prometheus (root)")
    parser.add_argument("--label", help="the lab's label (default: the stack name)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--prometheus", metavar="URL", help="ask this Prometheus")
    args = parser.parse_args(argv)
    try:
        cluster = stackfile.load(args.stack)
    except (ConfigError, FileNotFoundError) as error:
        print(f"doctor {args.stack}: cannot read the stack: {error}", file=sys.stderr)
        return 2
    try:
        if args.prometheus:
            fetch, url = http_fetch(args.prometheus), args.prometheus
        elif args.lab:
            if lab_fetch is None:
                raise Unreachable("--lab needs the lab library: run scripts/doctor.py")
            fetch, url = lab_fetch(args.stack, args.label)
        else:
            url = stack_output_url(args.stack) or configured_url(cluster)
            if url is None:
                raise Unreachable(f"stack {args.stack} runs no Prometheus (monitoring.prometheus is false)")
            fetch = http_fetch(url)
        found = findings(fetch, cluster)
    except Unreachable as error:
        if args.json:
            print(json.dumps({"healthy": False, "error": f"cannot ask Prometheus: {error}", "findings": []}))
        else:
            print(f"doctor {args.stack}: cannot ask Prometheus: {error}", file=sys.stderr)
        return 2
    if args.json:
        document = {"healthy": not found, "prometheus": url, "findings": [f.as_json() for f in found]}
        print(json.dumps(document, indent=2))
    else:
        print_human(args.stack, url, found)
    return 1 if found else 0
