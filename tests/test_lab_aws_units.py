"""The AWS lab's parts without namespaces: SSM parameters, targets and rate controls, cloud-init's
user data, the node role's IAM policy against the calls the node scripts make, the NLB's health
check as HAProxy runs it, and the staging document run twice at once (a fault the lab found)."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from labkit.aws import elb, iam, machine, model, service, ssmrun
from labkit.aws.lab import lab_config, pace_documents
from labkit.cluster import endpoint
from labkit.engine import executor, substitutions
from qwen_cluster.render import ssm
from tests.helpers.wait import wait_until
from tooling import iampolicy, stackfile

S3_URI = "s3://qwen-cluster-lab-weights/Qwen/Qwen3-32B/"


@pytest.fixture(scope="module")
def dev() -> model.AwsStack:
    raw = stackfile.read("dev")
    raw["qwen-cluster:model"] = {**raw["qwen-cluster:model"], "weights": {"source": "s3", "uri": S3_URI}}
    raw, _ = lab_config(raw)
    identity = endpoint.ensure(Path(tempfile.mkdtemp()) / "endpoint", "10.42.1.4")
    rendered, _ = executor.render(raw, "dev", 1 / 30, None, identity)
    return model.read(rendered, "us-west-2", S3_URI)


def _document(parameters: dict, lines: list[str]) -> dict:
    return {
        "schemaVersion": "2.2",
        "parameters": parameters,
        "mainSteps": [{"action": "aws:runShellScript", "name": "s", "inputs": {"runCommand": lines}}],
    }


def _instance(node: str, **tags: str) -> model.Instance:
    return model.Instance(node, node, f"i-{node}", "10.0.0.1", tags, "#!/bin/sh\n", "p", {})


def _association(targets: list, concurrency: str = "1", errors: str = "0") -> model.Association:
    return model.Association("a", "d", targets, {}, concurrency, errors, None)


# ------------------------------------------------------------------ SSM parameters


def test_ssm_fills_parameters_as_given_and_defaults_the_others():
    document = _document(
        {"A": {"type": "String", "default": "x"}, "B": {"type": "String", "default": "dflt"}},
        ["echo '{{ A }}' {{B}}"],
    )
    (step,) = ssmrun.steps(document, {"A": "given"})
    assert step.lines == ["echo 'given' dflt"]


def test_ssm_refuses_a_value_outside_its_allowed_pattern():
    document = _document({"Port": {"type": "String", "default": "", "allowedPattern": "^[0-9]+$"}}, ["x"])
    with pytest.raises(ssmrun.DocumentError, match="InvalidParameters"):
        ssmrun.steps(document, {"Port": "80; rm -rf /"})


def test_ssm_refuses_a_placeholder_the_document_does_not_declare():
    with pytest.raises(ssmrun.DocumentError, match="InvalidDocumentContent"):
        ssmrun.steps(_document({}, ["docker ps --format '{{ .Names }}'"]), {})


def test_every_registered_document_fills_with_its_associations_parameters(dev):
    for association in dev.associations.values():
        steps = ssmrun.steps(dev.documents[association.document], association.parameters)
        text = "\n".join(line for step in steps for line in step.lines)
        assert "{{" not in text, association.resource
        assert text.startswith("#!/bin/bash"), association.resource  # sh -c FILE: the #! decides


def test_the_lab_paces_the_documents_polls_and_nothing_else(dev):
    """pace_documents puts the documents' polls on the lab clock (the model server's health wait
    polls every 10 s, the drain every second) as bare metal's scripts'
    (substitutions.script_clock); no other line."""
    paced = copy.deepcopy(dev)
    made = pace_documents(paced, 1 / 30)
    assert substitutions.SCRIPT_CLOCK_NOTE + ", in the documents" in made
    changed = []
    for name, content in dev.documents.items():
        for step, lab_step in zip(content["mainSteps"], paced.documents[name]["mainSteps"], strict=True):
            lines, lab_lines = step["inputs"].get("runCommand", []), lab_step["inputs"].get("runCommand", [])
            changed += [(old, new) for old, new in zip(lines, lab_lines, strict=True) if old != new]
    assert ("    sleep 10", "    sleep 0.333") in changed  # the health wait's poll
    # The health wait's bound is a real-speed wait (a container's start, a server's load): as set.
    health = {name: a.parameters.get("HealthSeconds") for name, a in dev.associations.items()}
    assert {name: a.parameters.get("HealthSeconds") for name, a in paced.associations.items()} == health
    assert "1800" in health.values()
    for old, new in changed:  # and only whole-line sleeps, each on the lab clock
        indent, seconds = re.fullmatch(r"(\s*)sleep (\d+)", old).groups()
        assert new == f"{indent}sleep {max(0.1, round(int(seconds) / 30, 3)):g}"


# ------------------------------------------------------------------ targets and rate controls


def test_targets_select_by_instance_id_and_by_every_tag():
    instances = {n: _instance(n, role="gpu", stack="dev" if n != "c" else "prod") for n in "abc"}
    by_id = _association([{"key": "InstanceIds", "values": ["i-b"]}])
    by_tags = _association([{"key": "tag:role", "values": ["gpu"]}, {"key": "tag:stack", "values": ["dev"]}])
    assert [i.node for i in ssmrun.targets(by_id, instances)] == ["b"]
    assert [i.node for i in ssmrun.targets(by_tags, instances)] == ["a", "b"]


def test_rate_controls_cap_concurrency_and_stop_new_targets_after_max_errors():
    instances = {n: _instance(n, role="gpu") for n in "abcdef"}
    running, most, left, cap, lock = [0], [0], [0], [0], threading.Lock()
    a_failed = threading.Event()

    def runner(instance, steps):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        # Each run holds until as many run as the cap lets (or all that are left): a run that
        # exceeded the cap would show in `most`; one that never could is waited for, bounded.
        wait_until(lambda: running[0] >= min(cap[0], left[0]), what="the runs the cap allows", timeout=10)
        if instance.node != "a":  # a's failure reaches the run before any other result
            wait_until(a_failed.is_set, what="a's failure", timeout=10)
        with lock:
            running[0] -= 1
            left[0] -= 1
        if instance.node == "a":
            a_failed.set()
            return ssmrun.FAILED, 1, ""
        return ssmrun.SUCCESS, 0, ""

    every = [{"key": "tag:role", "values": ["gpu"]}]
    document = _document({}, ["true"])
    cap[0], left[0] = 3, 3  # the first failure (a) starts nothing new: a, b, c run
    result = ssmrun.run(_association(every, "50%", "0"), document, instances, runner)
    assert most[0] == 3  # 50 % of 6
    assert result.status == ssmrun.FAILED
    assert result.skipped == ["d", "e", "f"]
    cap[0], left[0], most[0] = 2, 6, 0
    a_failed.clear()
    relaxed = ssmrun.run(_association(every, "2", "1"), document, instances, runner)
    assert relaxed.skipped == [] and relaxed.status == ssmrun.FAILED
    assert most[0] == 2


# ------------------------------------------------------------------ cloud-init


def test_user_data_runs_as_a_script_plain_or_gzipped_and_other_formats_are_refused():
    script = "#!/bin/bash\necho first boot\n"
    assert machine.user_data_script(script) == script
    assert machine.user_data_script(gzip.compress(script.encode())) == script
    with pytest.raises(ssmrun.DocumentError):
        machine.user_data_script("#cloud-config\nruncmd: [true]\n")


def test_every_node_boots_a_script_that_names_its_own_address(dev):
    for instance in dev.instances.values():
        text = machine.user_data_script(instance.user_data)
        assert f"NODE_IP={instance.ip}" in text


# ------------------------------------------------------------------ the node role


def _node_role(dev: model.AwsStack) -> iampolicy.Principal:
    role = dev.role_of_instance(dev.instances["master"])
    return iampolicy.Principal(
        role, iam.documents_of_role(role, dev.role_policies[role], dev.role_attachments[role])
    )


def test_the_node_role_allows_every_call_the_node_scripts_make(dev):
    principal = _node_role(dev)
    group = dev.target_group.arn
    proxy = dev.associations["node-proxy-master"].parameters
    calls = [
        iampolicy.Request("elasticloadbalancing:DeregisterTargets", (group,)),
        iampolicy.Request("elasticloadbalancing:RegisterTargets", (group,)),
        iampolicy.Request("elasticloadbalancing:DescribeTargetHealth", (group,)),
        *(
            iampolicy.Request("ssm:GetParameter", (proxy[key],))
            for key in ("KeysParameter", "CertificateParameter")
        ),
        iampolicy.Request(
            "s3:ListBucket", ("arn:aws:s3:::qwen-cluster-lab-weights",), {"s3:prefix": "Qwen/Qwen3-32B/"}
        ),
        iampolicy.Request(
            "s3:GetObject", ("arn:aws:s3:::qwen-cluster-lab-weights/Qwen/Qwen3-32B/config.json",)
        ),
    ]
    for call in calls:
        assert principal.evaluate(call).allowed, call


def test_the_node_role_refuses_what_it_does_not_need(dev):
    principal = _node_role(dev)
    other_group = dev.target_group.arn.replace("targetgroup/", "targetgroup/x")
    refused = [
        iampolicy.Request("elasticloadbalancing:RegisterTargets", (other_group,)),
        iampolicy.Request(
            "ssm:PutParameter", ("arn:aws:ssm:us-west-2:123456789012:parameter/qwen-cluster/dev/x",)
        ),
        iampolicy.Request(
            "s3:ListBucket", ("arn:aws:s3:::qwen-cluster-lab-weights",), {"s3:prefix": "other/"}
        ),
        iampolicy.Request("s3:GetObject", ("arn:aws:s3:::qwen-cluster-lab-weights/other/file",)),
        iampolicy.Request("s3:PutObject", ("arn:aws:s3:::qwen-cluster-lab-weights/Qwen/Qwen3-32B/x",)),
    ]
    for call in refused:
        decision = principal.evaluate(call)
        assert not decision.allowed and "not authorized" in decision.reason, call


def test_the_node_role_reads_no_parameter_of_another_stack(dev):
    """AmazonSSMManagedInstanceCore allows ssm:GetParameter on "*": without the role's deny
    outside the stack's prefix, a dev node could read prod's API keys."""
    principal = _node_role(dev)
    for name in ("/qwen-cluster/prod/endpoint/api-keys", "/other-team/database-password"):
        arn = f"arn:aws:ssm:us-west-2:123456789012:parameter{name}"
        assert not principal.evaluate(iampolicy.Request("ssm:GetParameter", (arn,))).allowed, name
    own = dev.associations["node-proxy-master"].parameters["KeysParameter"]
    assert principal.evaluate(iampolicy.Request("ssm:GetParameter", (own,))).allowed


def test_policies_and_parameters_name_the_same_arns(dev):
    """The ARNs the associations hand the nodes are the ones the policies grant (as AWS builds
    them from the parameter's name), not the mocks' placeholders."""
    arns = {parameter["arn"] for parameter in dev.parameters.values()}
    proxy = dev.associations["node-proxy-master"].parameters
    assert {proxy["KeysParameter"], proxy["CertificateParameter"], proxy["PrivateKeyParameter"]} <= arns
    assert all(
        arn.startswith("arn:aws:ssm:us-west-2:123456789012:parameter/qwen-cluster/dev/") for arn in arns
    )
    assert "arn:aws:mock" not in json.dumps(dev.role_policies)


def test_the_lab_sets_a_monitoring_password_that_only_the_monitoring_instance_reads(dev):
    """The lab's dev has Prometheus behind the lab's monitoring password and a certificate of the
    lab's CA, as its bare-metal labs: the monitoring node's association names the four
    SecureString parameters, and the role (one
    for every node) lets that instance read them and no other, with the context the lab's API
    stand-in gives each node's credentials (labkit/aws/standins.py)."""
    master = dev.associations["monitoring-master"].parameters
    keys = ("WebConfigParameter", "PasswordParameter", "TlsCertificateParameter", "TlsPrivateKeyParameter")
    wanted = {master[key] for key in keys}
    names = {p["arn"]: p["name"] for p in dev.parameters.values()}
    assert {names[arn] for arn in wanted} == {
        "/qwen-cluster/dev/monitoring/web-config",
        "/qwen-cluster/dev/monitoring/password",
        "/qwen-cluster/dev/monitoring/tls-certificate",
        "/qwen-cluster/dev/monitoring/tls-private-key",
    }
    assert "WebConfigParameter" not in dev.associations["monitoring-worker-1"].parameters
    principal = _node_role(dev)

    def reads(node: str) -> bool:
        arn = model.instance_arn(dev.region, dev.instances[node].instance_id)
        context = {"ec2:SourceInstanceARN": arn}
        return all(
            principal.evaluate(iampolicy.Request("ssm:GetParameter", (parameter,), context)).allowed
            for parameter in wanted
        )

    assert reads("master") and not reads("worker-1")


# ------------------------------------------------------------------ the load balancer


def test_haproxy_checks_as_the_target_group_says_on_the_lab_clock(dev):
    text = elb.haproxy_config(
        dev.target_group, {"i-1": "10.42.1.100"}, listen="10.42.1.4", port=80, client_cidrs=["10.0.0.0/8"],
        idle_timeout=120, clock=1 / 30, socket_path="/tmp/x.sock", pid_file="/tmp/x.pid",
    )  # fmt: skip
    assert "option httpchk GET /health" in text
    assert "check-ssl verify none" in text  # loadBalancer.tls: the proxy answers HTTPS
    assert "rise 3 fall 3" in text and "inter 1000ms" in text  # 10 s x 1/30, at the 1 s floor
    assert "reject unless { src 10.0.0.0/8 }" in text
    assert "server i-1 10.42.1.100:5000" in text and text.rstrip().endswith("disabled")
    if shutil.which("haproxy"):
        with tempfile.NamedTemporaryFile("w", suffix=".cfg") as conf:
            conf.write(text)
            conf.flush()
            assert subprocess.run(["haproxy", "-c", "-f", conf.name], capture_output=True).returncode == 0


# ------------------------------------------------------------------ a fault the lab found


@pytest.mark.skipif(not shutil.which("bash"), reason="bash not installed")
def test_two_overlapping_staging_runs_on_one_node_both_succeed(tmp_path):
    """On a new machine the stack-wide staging and the node's own run the staging document at
    once. With one shared temporary file, one run moved the other's away (`mv: cannot stat`)
    and failed its association; each run now writes its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # base64 slow enough that both runs are between writing and renaming at the same time.
    (bin_dir / "base64").write_text('#!/bin/sh\nsleep 0.3\nexec /usr/bin/base64 "$@"\n')
    (bin_dir / "base64").chmod(0o755)
    etc = tmp_path / "etc-qwen-cluster"
    stage = "echo staged\n"
    text = ssm.stage_run_script().replace("/etc/qwen-cluster", str(etc))
    text = text.replace("{{ StageScript }}", ssm._encode(stage))
    script = tmp_path / "run.sh"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    runs = [subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(2)]  # fmt: skip
    results = [(run.wait(timeout=30), run.stdout.read()) for run in runs]
    assert [code for code, _ in results] == [0, 0], results
    assert (etc / "model-stage.sh").read_text() == stage


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not shutil.which("haproxy"), reason="haproxy not installed (scripts/setup-system.sh)")
def test_a_target_registered_before_it_listens_gets_no_connection_until_it_rises(tmp_path):
    """An NLB keeps a new target `initial` (no traffic) until its checks pass. HAProxy puts a
    server leaving maintenance UP at once ("UP 1/3"): the stand-in registers through drain and a
    forced `health down`. A node added later is an `add server` on the running HAProxy."""
    port, listen = _free_port(), _free_port()
    group = model.TargetGroup("tg", "arn:tg", port, "TCP", {"protocol": "HTTP", "path": "/health",
                              "interval": 1, "healthyThreshold": 2, "unhealthyThreshold": 3}, 0)  # fmt: skip
    sock_path = str(tmp_path / "haproxy.sock")
    conf = tmp_path / "haproxy.cfg"
    conf.write_text(elb.haproxy_config(group, {"i-old": "127.0.0.1"}, listen="127.0.0.1", port=listen,
                                       client_cidrs=["127.0.0.0/8"], idle_timeout=5, clock=1,
                                       socket_path=sock_path, pid_file=str(tmp_path / "pid")))  # fmt: skip
    haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(conf)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until(lambda: os.path.exists(sock_path), what="haproxy's socket", timeout=10)
        assert elb.add_server(sock_path, group, "i-new", "127.0.0.1", 1) == "i-new: server added"
        assert elb.add_server(sock_path, group, "i-new", "127.0.0.1", 1) == "i-new: already a server"
        assert elb.haproxy_status(sock_path)["i-new"].startswith("MAINT")
        stand_in = elb.TargetGroupStandIn(group, sock_path, 0)
        stand_in.register("i-new")  # nothing listens on the target's port yet
        seen = [elb.haproxy_status(sock_path)["i-new"] for _ in range(20)]
        assert all(status.startswith("DOWN") for status in seen), seen
        assert stand_in.describe(["i-new"]) == [("i-new", elb.INITIAL)]
    finally:
        haproxy.kill()
        haproxy.wait()


@pytest.mark.skipif(not Path("/usr/bin/aws").exists(), reason="no AWS CLI (scripts/setup-system.sh)")
def test_the_cli_finds_its_waiters_polling_on_the_lab_clock(tmp_path):
    from labkit.aws import lab

    data = lab.waiters_on_the_clock(tmp_path, 1 / 30)
    probe = (
        "import awscli.botocore.session as s; w = s.get_session().get_waiter_model('elbv2'); "
        "print(w.get_waiter('TargetInService').delay, w.get_waiter('TargetDeregistered').max_attempts)"
    )
    done = subprocess.run(["/usr/bin/python3", "-c", probe], env={**os.environ, "AWS_DATA_PATH": str(data)},
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.split() == ["1", "40"]  # 15 s x 1/30 at the 1 s floor; attempts as AWS's


@pytest.mark.parametrize(
    ("method", "query", "action"),
    [
        # S3 API Reference, HeadBucket: "you must have permissions to perform the s3:ListBucket action".
        ("HEAD", {}, "s3:ListBucket"),
        ("HEAD", {"x-id": ["HeadBucket"]}, "s3:ListBucket"),
        # GetBucketLocation (`GET /?location`) is its own action, s3:GetBucketLocation.
        ("GET", {"location": [""]}, "s3:GetBucketLocation"),
        ("GET", {"list-type": ["2"], "prefix": ["Qwen/"]}, "s3:ListBucket"),
        ("GET", {}, "s3:ListBucket"),
    ],
)
def test_the_lab_s3_names_a_bucket_call_as_iam_does(method, query, action):
    request = service.s3_request("qwen-weights.s3.us-west-2.amazonaws.com", method, "/", query)
    assert (request.action, request.resources) == (action, ("arn:aws:s3:::qwen-weights",))


def test_a_head_bucket_carries_no_prefix_so_a_prefix_bound_listing_grant_does_not_cover_it():
    request = service.s3_request("s3.us-west-2.amazonaws.com", "HEAD", "/qwen-weights", {})
    assert request.context == {}
