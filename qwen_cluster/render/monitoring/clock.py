"""The monitoring clock: every duration (alert `for:`, rate and XID windows, Alertmanager's
grouping) is written for the default 15 s scrape and scales with
`monitoring.scrapeIntervalSeconds` (an alert waits four scrapes, not a fixed minute). The lab
puts that key on its clock like the thinking pause, and the whole monitoring stack runs at the
lab's pace.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SCRAPE_SECONDS = 15


def clock(cluster) -> float:
    """How much faster or slower than the default every monitoring duration runs."""
    return cluster.monitoring.scrape_interval_seconds / DEFAULT_SCRAPE_SECONDS


def duration(seconds: float, scale: float = 1.0) -> str:
    """A Prometheus duration for `seconds` on a clock running at `scale` (at least 100 ms)."""
    millis = max(100, round(seconds * scale * 1000))
    if millis % 60000 == 0:
        return f"{millis // 60000}m"
    if millis % 1000 == 0:
        return f"{millis // 1000}s"
    return f"{millis}ms"


@dataclass(frozen=True)
class Timing:
    """The scrape interval and the timeouts that must fit inside it."""

    scrape: float  # seconds

    @property
    def scrape_timeout(self) -> float:
        return round(self.scrape * 0.8, 3)

    @property
    def probe_timeout(self) -> float:
        """blackbox_exporter's module timeout: a probe of a peer that is gone ends here."""
        return round(min(2.0, self.scrape * 0.4), 3)

    @property
    def fetch_timeout(self) -> float:
        """How long the endpoint waits for each source and probe (all in parallel): longer
        than a probe, so a failed probe arrives as probe_success 0 (not as a silent blackbox),
        and shorter than Prometheus's scrape timeout, so the scrape still succeeds."""
        return round(min(self.probe_timeout + 1.0, self.scrape * 0.7), 3)


def timing(cluster) -> Timing:
    return Timing(scrape=cluster.monitoring.scrape_interval_seconds)
