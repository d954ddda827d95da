"""A node's monitoring endpoint: one `GET :8000/metrics` with every local exporter's metrics.

Fetches, in parallel and from loopback, each source (node_exporter, dcgm-exporter, vLLM) and
each peer probe (blackbox_exporter's /probe), and serves them merged in the Prometheus text
format. Every sample gets `qwen_source="<source>"` (two sources may both export, say,
`process_cpu_seconds_total`); probe samples also get the probe's labels (peer, module,
port). Its own metrics:
    qwen_source_up{qwen_source}                   1 if the source answered this scrape
    qwen_source_scrape_duration_seconds{qwen_source}
    qwen_node_nic_info{device, address}           the NIC holding the node IP
    qwen_efa_errors_total{device, port, counter}  EFA's error counters (config `efa_sysfs`, AWS)
so a dead exporter is a 0, never a silent gap. Stdlib only: it runs in any Python image.

Run: python3 nodemetrics.py CONFIG.json   (config rendered by qwen_cluster/render/monitoring/endpoint.py)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

try:  # on a node: nic.py is shipped next to this file (qwen_cluster/render/monitoring/containers.py)
    from nic import interface_of
except ImportError:  # imported from the program's package (tests)
    from qwen_cluster.node.nic import interface_of

SOURCE_LABEL = "qwen_source"
SELF = "nodemetrics"
PROBE = "probe"
ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info", "_gcount", "_gsum")


@dataclass
class Family:
    name: str
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_text(labels: dict[str, str]) -> str:
    return ",".join(f'{key}="{escape(value)}"' for key, value in labels.items())


def split_sample(line: str) -> tuple[str, str, str]:
    """`name{labels} rest` -> (name, labels text without braces, rest)."""
    brace = line.find("{")
    space = line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        return line[:space], "", line[space + 1 :]
    index, quoted = brace + 1, False
    while index < len(line):
        char = line[index]
        if quoted and char == "\\":
            index += 2
            continue
        if char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            break
        index += 1
    return line[:brace], line[brace + 1 : index].strip().rstrip(","), line[index + 1 :].strip()


class Merger:
    """Metric families in first-seen order, samples of one family kept together."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}
        self.typed: dict[str, str] = {}  # sample name -> family name, from TYPE lines

    def family(self, name: str) -> Family:
        return self.families.setdefault(name, Family(name))

    def family_of(self, sample: str) -> str:
        if sample in self.typed:
            return self.typed[sample]
        for suffix in SUFFIXES:
            if sample.endswith(suffix) and sample[: -len(suffix)] in self.families:
                base = self.families[sample[: -len(suffix)]]
                if base.type in ("histogram", "summary", "counter", "gaugehistogram", "info"):
                    return base.name
        return sample

    def add_text(self, text: str, labels: dict[str, str]) -> None:
        ours = label_text(labels)
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = self.family(parts[2])
                    value = parts[3] if len(parts) > 3 else ""
                    if parts[1] == "HELP" and family.help is None:
                        family.help = value
                    elif parts[1] == "TYPE" and family.type is None:
                        family.type = value
                        self.typed[family.name] = family.name
                continue
            name, existing, rest = split_sample(line)
            if not name or not rest:
                continue
            joined = ours if not existing else f"{ours},{existing}" if ours else existing
            self.family(self.family_of(name)).samples.append(f"{name}{{{joined}}} {rest}")

    def add(self, name: str, kind: str, help_text: str, labels: dict[str, str], value: float) -> None:
        family = self.family(name)
        family.help = family.help or help_text
        family.type = family.type or kind
        self.typed[name] = name
        family.samples.append(f"{name}{{{label_text(labels)}}} {value:g}")

    def text(self) -> str:
        lines: list[str] = []
        for family in self.families.values():
            if not family.samples:
                continue
            if family.help is not None:
                lines.append(f"# HELP {family.name} {family.help}")
            if family.type is not None:
                lines.append(f"# TYPE {family.name} {family.type}")
            lines += family.samples
        return "\n".join(lines) + "\n"


def fetch(url: str, timeout: float) -> str:
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode("utf-8", "replace")


def nic_of(address: str) -> str | None:
    """The interface holding `address` (IPv4), by the program's one finder (nic.py, shipped
    next to this file)."""
    return interface_of(address)


# EFA's per-port error counters (Linux drivers/infiniband/hw/efa/efa_verbs.c EFA_DEFINE_PORT_STATS,
# read from /sys/class/infiniband/<device>/ports/<port>/hw_counters/): packets dropped on receive
# and RDMA work requests that failed. Any increase means NCCL traffic is being lost or retried.
EFA_ERROR_COUNTERS = ("rx_drops", "rdma_read_wr_err", "rdma_write_wr_err")


def efa_errors(root: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every EFA error counter under `root` (/sys/class/infiniband)."""
    found = []
    base = Path(root)
    for counters in sorted(base.glob("*/ports/*/hw_counters")):
        device, port = counters.parents[2].name, counters.parent.name
        for name in EFA_ERROR_COUNTERS:
            try:
                value = float((counters / name).read_text().strip())
            except (OSError, ValueError):
                continue
            found.append(({"device": device, "port": port, "counter": name}, value))
    return found


class Collector:
    def __init__(self, config: dict):
        self.config = config
        self.timeout = float(config.get("timeout", 2.0))
        jobs = len(config.get("sources", [])) + len(config.get("probes", []))
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(32, jobs)))

    def _timed(self, url: str) -> tuple[str | None, float]:
        started = time.monotonic()
        try:
            return fetch(url, self.timeout), time.monotonic() - started
        except (OSError, ValueError):
            return None, time.monotonic() - started

    def collect(self) -> str:
        sources = self.config.get("sources", [])
        probes = self.config.get("probes", [])
        source_jobs = [self.pool.submit(self._timed, source["url"]) for source in sources]
        probe_jobs = [self.pool.submit(self._timed, probe["url"]) for probe in probes]
        merged = Merger()
        up_help = "1 if the source answered this scrape of the monitoring endpoint, else 0."
        took_help = "Seconds the source took to answer."
        for source, job in zip(sources, source_jobs, strict=True):
            text, took = job.result()
            if text is not None:
                merged.add_text(text, {SOURCE_LABEL: source["name"]})
            merged.add(
                "qwen_source_up", "gauge", up_help, {SOURCE_LABEL: source["name"]}, int(text is not None)
            )
            merged.add(
                "qwen_source_scrape_duration_seconds",
                "gauge",
                took_help,
                {SOURCE_LABEL: source["name"]},
                took,
            )
        if probes:
            answered, slowest = 0, 0.0
            for probe, job in zip(probes, probe_jobs, strict=True):
                text, took = job.result()
                slowest = max(slowest, took)
                if text is not None:
                    answered += 1
                    merged.add_text(text, {SOURCE_LABEL: PROBE, **probe["labels"]})
            # A probe blackbox did not answer is left out, not reported as a failed probe:
            # the peer may be fine; the source is what is down.
            merged.add(
                "qwen_source_up", "gauge", up_help, {SOURCE_LABEL: PROBE}, int(answered == len(probes))
            )
            merged.add(
                "qwen_source_scrape_duration_seconds", "gauge", took_help, {SOURCE_LABEL: PROBE}, slowest
            )
        address = self.config.get("node_ip")
        device = nic_of(address) if address else None
        if device:
            merged.add(
                "qwen_node_nic_info",
                "gauge",
                "The NIC holding the node IP (join with node_network_speed_bytes on device).",
                {SOURCE_LABEL: SELF, "device": device, "address": address},
                1,
            )
        efa_root = self.config.get("efa_sysfs")
        for labels, value in efa_errors(efa_root) if efa_root else []:
            merged.add(
                "qwen_efa_errors_total",
                "counter",
                "EFA error counters (hw_counters: rx_drops, rdma_read_wr_err, rdma_write_wr_err).",
                {SOURCE_LABEL: SELF, **labels},
                value,
            )
        return merged.text()


def handler_for(collector: Collector):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, status, kind = collector.collect().encode(), 200, "text/plain; version=0.0.4"
            elif path == "/":
                body = f"{collector.config.get('node', '')} monitoring endpoint: /metrics\n".encode()
                status, kind = 200, "text/plain"
            else:
                body, status, kind = b"not found\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
            pass

    return Handler


def serve(config: dict) -> ThreadingHTTPServer:
    host, _, port = config["listen"].rpartition(":")
    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), handler_for(Collector(config)))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: nodemetrics.py CONFIG.json")
    with open(args[0], encoding="utf-8") as handle:
        config = json.load(handle)
    server = serve(config)
    print(f"nodemetrics {config.get('node', '')} on {config['listen']}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
