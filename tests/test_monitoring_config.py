"""The `monitoring` section and the port-table rows it needs."""

from __future__ import annotations

import pytest

from qwen_cluster.config import ConfigError, validate
from tooling import stackfile


def errors_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(raw)
    return caught.value.errors


def guide_table() -> list[dict]:
    return [
        {"name": "model-service", "port": 5000, "scope": "clients"},
        {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
        {"name": "monitoring", "port": 8000, "scope": "monitoring", "required": False},
    ]


def test_on_by_default_on_the_master(bare_metal_raw):
    cluster = validate(bare_metal_raw)
    assert cluster.monitoring.prometheus and cluster.monitoring.exporters
    assert cluster.monitoring_node.name == "master"


def test_a_table_copied_from_the_guide_gets_prometheus_and_alertmanager_rows(bare_metal_raw):
    bare_metal_raw["ports"] = guide_table()
    ports = {entry.name: str(entry.port) for entry in validate(bare_metal_raw).ports}
    assert ports["prometheus"] == "9090" and ports["alertmanager"] == "9093"


def test_a_written_row_moves_prometheus(bare_metal_raw):
    bare_metal_raw["ports"] = [*guide_table(), {"name": "prometheus", "port": 9191, "scope": "monitoring"}]
    ports = {entry.name: str(entry.port) for entry in validate(bare_metal_raw).ports}
    assert ports["prometheus"] == "9191"


def test_off_adds_no_rows(bare_metal_raw):
    bare_metal_raw["ports"] = guide_table()
    bare_metal_raw["monitoring"] = {"prometheus": False}
    names = [entry.name for entry in validate(bare_metal_raw).ports]
    assert names == ["model-service", "inter-node", "monitoring"]
    assert validate(bare_metal_raw).monitoring_node is None


def test_a_taken_default_port_asks_for_a_row(bare_metal_raw):
    bare_metal_raw["ports"] = [*guide_table(), {"name": "ops", "port": "9000-9095", "scope": "admin"}]
    errors = errors_of(bare_metal_raw)
    assert any(
        "monitoring.prometheus is true but needs a ports entry named prometheus, and its default port "
        "9090 is taken by ops (9000-9095); add {name: prometheus, port: <free port>, scope: monitoring, "
        "required: false}" in error
        for error in errors
    ), errors


def test_prometheus_row_must_be_monitoring_scope(bare_metal_raw):
    bare_metal_raw["ports"] = [*guide_table(), {"name": "prometheus", "port": 9090, "scope": "clients"}]
    assert any(
        "ports entry prometheus (9090, scope clients) must be a single port with scope monitoring" in error
        for error in errors_of(bare_metal_raw)
    )


def test_monitoring_node_must_be_a_node(bare_metal_raw):
    bare_metal_raw["monitoring"] = {**bare_metal_raw["monitoring"], "node": "worker-9"}
    assert errors_of(bare_metal_raw) == ["monitoring.node worker-9 is not one of the nodes"]


def test_table_must_leave_the_exporters_loopback_ports_free(bare_metal_raw):
    bare_metal_raw["ports"] = [*guide_table(), {"name": "ops", "port": 9100, "scope": "admin"}]
    assert errors_of(bare_metal_raw) == [
        "ports[3].port 9100 (ops) includes 9100, where the node exporter listens on each node's loopback"
    ]


def test_bounds_are_checked(bare_metal_raw):
    bare_metal_raw["monitoring"] = {"maxRequestsWaiting": 0, "maxTtftP99Seconds": -1}
    errors = errors_of(bare_metal_raw)
    assert any(error.startswith("monitoring.maxRequestsWaiting 0") for error in errors)
    assert any(error.startswith("monitoring.maxTtftP99Seconds -1") for error in errors)


def test_unknown_monitoring_key_is_an_error(bare_metal_raw):
    bare_metal_raw["monitoring"] = {"prometheus": True, "grafana": True}
    assert errors_of(bare_metal_raw) == ["monitoring.grafana is not a known key"]


# --- the password, or a word that the monitoring surface is open -------------------------------

SET_PASSWORD = (
    "pulumi config set --secret --path 'qwen-cluster:monitoring.password' \"$(openssl rand -hex 24)\""
)


def test_prometheus_without_a_password_is_refused_naming_the_key_and_the_command(bare_metal_raw):
    bare_metal_raw["monitoring"] = {"prometheus": True}
    (error,) = errors_of(bare_metal_raw)
    assert error.startswith("monitoring.password is not set: Prometheus and Alertmanager would answer")
    assert SET_PASSWORD in error and "monitoring.openToMonitoringCidrs: true" in error


def test_a_stack_may_say_its_monitoring_is_open_on_purpose(bare_metal_raw):
    bare_metal_raw["monitoring"] = {"openToMonitoringCidrs": True}
    assert validate(bare_metal_raw).monitoring.open_to_monitoring_cidrs


def test_a_password_and_the_open_word_together_are_refused(bare_metal_raw):
    bare_metal_raw["monitoring"] = {**bare_metal_raw["monitoring"], "openToMonitoringCidrs": True}
    assert errors_of(bare_metal_raw) == [
        "monitoring.openToMonitoringCidrs is true but monitoring.password is set: remove one or the other"
    ]


def test_without_prometheus_no_password_is_needed(bare_metal_raw):
    bare_metal_raw["monitoring"] = {"prometheus": False}
    assert validate(bare_metal_raw).monitoring.password is None


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_the_committed_stacks_without_their_secret_are_refused_naming_the_monitoring_password(stack):
    raw = stackfile.cluster_keys(stackfile.read(stack, offline_keys=False))
    (error,) = errors_of({**raw, "access": {**raw["access"], "openEndpoint": True}})
    assert error.startswith("monitoring.password is not set") and SET_PASSWORD in error


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_the_offline_tools_give_them_a_throwaway_password_and_say_so(stack):
    stack_config = stackfile.read(stack)
    assert validate(stackfile.cluster_keys(stack_config)).monitoring.password is not None
    values, _ = stackfile.as_pulumi_config(stack_config)
    assert stackfile.OFFLINE_MONITORING_PASSWORD in values["qwen-cluster:monitoring"]
    assert "monitoring.password" in stackfile.offline_placeholders(stack_config)
