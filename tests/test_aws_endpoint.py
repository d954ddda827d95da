"""The locked endpoint on AWS: a proxy on every replica head (keys, route allowlist, TLS) in front
of vLLM on loopback; the secrets are SecureString parameters, secret end to end; a key change
reloads the proxies and restarts no model server."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

from qwen_cluster.config import NAMESPACE
from qwen_cluster.render import nginx, proxy, ssm
from tests.helpers.aws_stacks import render
from tests.helpers.baremetal import shellcheck
from tests.helpers.secrets import shown_in_clear
from tooling import changes, stackfile

KEY = "aws-test-key-" + "7" * 40
OTHER_KEY = "aws-test-key-" + "8" * 40
# A pair the program's parse accepts (qwen_cluster/config/x509check.py), handed over as a secret.
CERTIFICATE = stackfile.OFFLINE_TLS_CERTIFICATE
PRIVATE_KEY = stackfile.OFFLINE_TLS_PRIVATE_KEY


def stack(keys=(KEY,), tls: bool = True) -> dict:
    config = stackfile.read("dev")
    access = {**config[f"{NAMESPACE}:access"], "apiKeys": [{"secure": key} for key in keys]}
    config = {**config, f"{NAMESPACE}:access": access}
    if tls:
        balancer = {
            **config[f"{NAMESPACE}:loadBalancer"],
            "tls": {"certificate": {"secure": CERTIFICATE}, "privateKey": {"secure": PRIVATE_KEY}},
        }
        config[f"{NAMESPACE}:loadBalancer"] = balancer
    return config


def test_every_replica_head_gets_a_proxy_on_its_address_and_the_model_port():
    result = render(stack())
    proxies = {r.name: r.inputs["parameters"] for r in result.of_type("aws:ssm/association:Association")
               if r.name.startswith("node-proxy-")}  # fmt: skip
    assert set(proxies) == {"node-proxy-master", "node-proxy-worker-1"}
    assert proxies["node-proxy-master"]["NodeIp"] == "10.42.1.100"
    master = proxies["node-proxy-master"]
    assert (master["Port"], master["Scheme"]) == ("5000", "https")
    conf = base64.b64decode(proxies["node-proxy-master"]["NginxConf"]).decode()
    assert "listen 10.42.1.100:5000 ssl;" in conf and "server 127.0.0.1:5000 " in conf


def test_each_model_server_run_waits_for_its_own_proxy():
    result = render(stack())
    assert "node-proxy-master" in result.named("gpu-nodes-master-server").depends_on
    assert "node-proxy-worker-1" in result.named("gpu-nodes-worker-1-server").depends_on


def test_the_keys_and_tls_files_are_securestring_parameters_with_secret_values():
    result = render(stack())
    parameters = {r.name: r for r in result.of_type("aws:ssm/parameter:Parameter")}
    roles = ("api-keys", "tls-certificate", "tls-private-key")
    # The monitoring password's and TLS pair's four (the stack's offline placeholders) are
    # SecureStrings too.
    monitoring = {
        "monitoring-password",
        "monitoring-web-config",
        "monitoring-tls-certificate",
        "monitoring-tls-private-key",
    }
    assert set(parameters) == {f"node-proxy-{role}" for role in roles} | monitoring
    for parameter in parameters.values():
        assert parameter.inputs["type"] == "SecureString"
        value = parameter.inputs["value"]
        assert isinstance(value, dict) and "value" in value  # the SDK's secret wrapper


def test_no_secret_is_in_plain_text_in_any_registered_input_on_aws():
    result = render(stack())
    for secret in (KEY, PRIVATE_KEY.splitlines()[1]):  # a line of the key itself
        assert shown_in_clear(result.resources, secret) == []


def test_no_secret_is_in_plain_text_in_any_registered_input_on_bare_metal():
    config = stackfile.read("onprem")
    config[f"{NAMESPACE}:access"] = {**config[f"{NAMESPACE}:access"], "apiKeys": [{"secure": KEY}]}
    config[f"{NAMESPACE}:loadBalancer"] = {
        **config[f"{NAMESPACE}:loadBalancer"],
        "tls": {"certificate": {"secure": CERTIFICATE}, "privateKey": {"secure": PRIVATE_KEY}},
    }
    result = render(config, "onprem")
    assert result.error is None
    for secret in (KEY, PRIVATE_KEY.splitlines()[1]):  # a line of the key itself
        assert shown_in_clear(result.resources, secret) == []


def test_the_nodes_may_read_exactly_those_parameters():
    result = render(stack())
    policy = json.loads(result.named("node-proxy-read").inputs["policy"])
    (statement,) = policy["Statement"]
    assert statement["Action"] == "ssm:GetParameter"
    assert len(statement["Resource"]) == 3


def test_with_tls_the_nlb_checks_health_over_https_and_keeps_its_tcp_listener():
    result = render(stack())
    (group,) = result.of_type("aws:lb/targetGroup:TargetGroup")
    assert group.inputs["healthCheck"]["protocol"] == "HTTPS"
    (listener,) = result.of_type("aws:lb/listener:Listener")
    # TLS ends on the node's proxy: the NLB keeps TCP and its configurable idle timeout (an NLB
    # TLS listener's is fixed at 350 s).
    assert listener.inputs["protocol"] == "TCP" and listener.inputs["tcpIdleTimeoutSeconds"] == 3600


def test_a_key_rotation_reloads_the_proxies_and_restarts_no_model_server():
    old, new = render(stack((KEY,))), render(stack((KEY, OTHER_KEY)))
    found = changes.diff(old, new)
    touched = {c.name: c.action for c in found if c.action != "same"}
    assert touched == {
        "node-proxy-api-keys": "update",
        "node-proxy-master": "replace",
        "node-proxy-worker-1": "replace",
    }
    summary = changes.rollout(old, new, found)
    assert summary.servers_restarted == [] and summary.max_replicas_out_of_service == 0


def test_the_proxy_run_passes_shellcheck(tmp_path):
    text = proxy.run_script()
    for name in proxy.PARAMETERS:
        text = text.replace("{{ " + name + " }}", "0")
    shellcheck(text, tmp_path)


def test_the_proxy_config_passes_gixy_ng():
    gixy = shutil.which("gixy", path=str(Path(sys.executable).parent))
    assert gixy, "gixy-ng is installed from requirements.txt"
    cluster = stackfile.validate(stack())
    path = Path(f"/tmp/qwen-proxy-{id(cluster)}.conf")
    path.write_text(proxy.conf(cluster, "master"))
    try:
        result = subprocess.run(
            [gixy, "-f", "json", "--nginx-version", nginx.IMAGE.removeprefix("nginx:"), str(path)],
            capture_output=True,
            text=True,
        )
    finally:
        path.unlink()
    assert json.loads(result.stdout or "null") == [], result.stdout


def test_the_model_server_waits_for_vllm_on_loopback():
    cluster = stackfile.validate(stack())
    assert ssm.parameters(cluster, "master")["HealthUrl"] == "http://127.0.0.1:5000/health"
