"""Monitoring on AWS: one SSM document, one association per node running the same
ContainerSpecs as bare metal; a new alert bound updates the monitoring node's association only."""

from __future__ import annotations

import hashlib
import json
import subprocess

from qwen_cluster.node import NODEMETRICS_SCRIPT
from qwen_cluster.render import monitoring_ssm
from qwen_cluster.render.monitoring import containers
from tests.helpers.configs import open_monitoring
from tooling import changes, offline, stackfile

NODEMETRICS = NODEMETRICS_SCRIPT.read_text()
ASSOCIATION = "aws:ssm/association:Association"


def render(stack: str, *edits: str) -> offline.Render:
    result = offline.render(changes.apply_changes(stackfile.read(stack), list(edits)), stack)
    assert result.error is None, result.error
    return result


def test_every_node_gets_its_monitoring_association_and_the_master_the_servers():
    dev = render("dev")
    associations = {r.name: r.inputs for r in dev.of_type(ASSOCIATION) if r.name.startswith("monitoring-")}
    assert set(associations) == {"monitoring-master", "monitoring-worker-1"}
    master = monitoring_ssm.unpack(associations["monitoring-master"]["parameters"]["Containers"])
    worker = monitoring_ssm.unpack(associations["monitoring-worker-1"]["parameters"]["Containers"])
    for name in ("qwen-node-exporter", "qwen-blackbox-exporter", "qwen-dcgm-exporter", "qwen-nodemetrics"):
        assert f"--name={name}" in master and f"--name={name}" in worker
    assert "--name=qwen-prometheus" in master and "--name=qwen-prometheus" not in worker
    assert associations["monitoring-worker-1"]["parameters"]["ServerFiles"] == ""
    assert "--gpus=all" in worker and containers.DCGM_EXPORTER_IMAGE in worker
    assert dev.outputs["prometheus"] == "https://10.42.1.100:9090"  # the offline TLS pair


def test_a_new_alert_bound_updates_the_monitoring_nodes_association_only():
    before, after = render("prod"), render("prod", "monitoring.maxRequestsWaiting=5")
    moved = [(c.name, c.action) for c in changes.diff(before, after) if c.action != "same"]
    assert moved == [("monitoring-master", "update")]
    summary = changes.rollout(before, after)
    assert summary.servers_restarted == [] and summary.nodes_replaced == []


def test_the_scripts_pass_shellcheck(tmp_path):
    cluster = stackfile.load("prod")
    scripts = {
        "run.sh": monitoring_ssm.shell_check_text(),
        "containers.sh": monitoring_ssm.unpack(
            monitoring_ssm.parameters(cluster, "master", NODEMETRICS)["Containers"]
        ),
        "files.sh": monitoring_ssm.unpack(
            monitoring_ssm.parameters(cluster, "master", NODEMETRICS)["ServerFiles"]
        ),
    }
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        checked = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, name + checked.stdout


def test_an_unchanged_container_is_kept_a_changed_one_replaced():
    """The run replaces a container only when its spec hash (a label) differs."""
    cluster = stackfile.load("dev")
    specs = containers.node_containers(cluster, "worker-1", NODEMETRICS)
    text = monitoring_ssm.containers_script(specs)
    for spec in specs:
        assert f"label={monitoring_ssm.CONFIG_LABEL}={monitoring_ssm.spec_hash(spec)}" in text
    other = stackfile.load("prod")
    changed = {
        s.name: monitoring_ssm.spec_hash(s)
        for s in containers.node_containers(other, "worker-1", NODEMETRICS)
    }
    same = {s.name: monitoring_ssm.spec_hash(s) for s in specs}
    assert changed["qwen-node-exporter"] == same["qwen-node-exporter"]  # nothing of the stack in it
    assert changed["qwen-nodemetrics"] != same["qwen-nodemetrics"]  # other peers to probe


# --- monitoring.password and monitoring.tls on AWS --------------------------------------------------

PASSWORD = "aws-monitoring-password-0123456789"
ROTATED = "aws-monitoring-password-rotated-9876"
PARAMETER = "aws:ssm/parameter:Parameter"
CREDENTIAL_NAMES = {
    f"/qwen-cluster/dev/monitoring/{role}"
    for role in ("web-config", "password", "tls-certificate", "tls-private-key")
}
CREDENTIAL_KEYS = {
    "Region",
    "WebConfigParameter",
    "PasswordParameter",
    "TlsCertificateParameter",
    "TlsPrivateKeyParameter",
    "SecretsVersion",
}
READ_ACTIONS = ("ssm:GetParameter", "ssm:GetParameters", "ssm:GetParameterHistory")
MONITORING_IPS = {"dev": "10.42.1.100", "prod": "10.50.1.100"}


def with_password(password: str = PASSWORD, stack: str = "dev", serial: int = 1) -> dict:
    from tests.helpers.monitoring_tls import issue, with_monitoring

    return with_monitoring(stackfile.read(stack), issue(MONITORING_IPS[stack], serial), password)


def _render(config: dict, stack: str = "dev") -> offline.Render:
    result = offline.render(config, stack)
    assert result.error is None, result.error
    return result


def _credentials(result: offline.Render) -> dict[str, offline.RecordedResource]:
    return {
        r.inputs["name"]: r
        for r in result.of_type(PARAMETER)
        if str(r.inputs.get("name", "")).startswith("/qwen-cluster/dev/monitoring/")
    }


def _secret(value):
    from tests.helpers.secrets import SECRET_SIG

    assert isinstance(value, dict) and SECRET_SIG in value, "not a secret"
    return value["value"]


def test_without_a_password_there_are_no_credential_parameters_and_no_read_grant():
    dev = _render(open_monitoring(stackfile.read("dev")))
    assert _credentials(dev) == {}
    assert [r.name for r in dev.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "monitoring-read"] == []
    for association in dev.of_type(ASSOCIATION):
        if association.name.startswith("monitoring-"):
            assert not CREDENTIAL_KEYS & set(association.inputs["parameters"]), association.name


def _files(password: str = PASSWORD, serial: int = 1) -> dict[str, str]:
    from tests.helpers.monitoring_tls import issue

    pki = issue(MONITORING_IPS["dev"], serial)
    return containers.secret_files(
        "dev", certificate=pki.certificate, private_key=pki.private_key, password=password
    )


def test_with_tls_and_a_password_the_secret_files_are_securestring_parameters_bare_metal_would_write():
    import bcrypt
    import yaml

    from qwen_cluster.render.monitoring import webconfig
    from tests.helpers.monitoring_tls import issue

    parameters = _credentials(_render(with_password()))
    assert set(parameters) == CREDENTIAL_NAMES
    assert {p.inputs["type"] for p in parameters.values()} == {"SecureString"}
    value = {name.rsplit("/", 1)[1]: _secret(p.inputs["value"]) for name, p in parameters.items()}
    # The same files, from the same function, as bare metal writes (containers.secret_files); the
    # node joins the chain and the key as containers.tls_pem does.
    files, pki = _files(), issue(MONITORING_IPS["dev"])
    assert (value["web-config"], value["password"]) == (files["web-tls.yml"].rstrip(), PASSWORD)
    assert (value["tls-certificate"], value["tls-private-key"]) == (
        pki.certificate.rstrip(),
        pki.private_key.rstrip(),
    )
    assert containers.tls_pem(value["tls-certificate"], value["tls-private-key"]) == files["tls.pem"]
    web = yaml.safe_load(value["web-config"])
    assert bcrypt.checkpw(PASSWORD.encode(), web["basic_auth_users"][webconfig.USER].encode())
    assert web["tls_server_config"]["cert_file"] == "/etc/qwen-monitoring/tls.pem"


def test_the_association_names_the_parameters_and_holds_no_secret():
    from tests.helpers.secrets import shown_in_clear

    result = _render(with_password())
    parameters = _credentials(result)
    master = result.named("monitoring-master").inputs["parameters"]
    arn = {name.rsplit("/", 1)[1]: p.outputs["arn"] for name, p in parameters.items()}
    assert (master["WebConfigParameter"], master["PasswordParameter"]) == (arn["web-config"], arn["password"])
    assert (master["TlsCertificateParameter"], master["TlsPrivateKeyParameter"]) == (
        arn["tls-certificate"],
        arn["tls-private-key"],
    )
    assert master["Region"] == "us-west-2"
    hashed = _files()["web-tls.yml"].split(": ")[-1].strip()
    key_line = _files()["tls.pem"].split("PRIVATE KEY-----\n", 1)[1].splitlines()[0]
    secrets = (PASSWORD, hashed, key_line)
    texts = [str(value) for value in master.values()]
    texts += [monitoring_ssm.unpack(master[name]) for name in ("Containers", "ServerFiles")]
    assert not [text for text in texts if any(secret in text for secret in secrets)]
    assert "--web.config.file=/etc/qwen-monitoring/web-tls.yml" in monitoring_ssm.unpack(master["Containers"])
    assert all(shown_in_clear(result.resources, secret) == [] for secret in secrets)
    for document in result.of_type("aws:ssm/document:Document"):
        assert not [secret for secret in secrets if secret in document.inputs["content"]]
    # The other nodes' associations know nothing of the credentials.
    assert not CREDENTIAL_KEYS & set(result.named("monitoring-worker-1").inputs["parameters"])


def test_only_the_monitoring_nodes_instance_may_read_the_credentials():
    """The GPU nodes share one role, whose managed AmazonSSMManagedInstanceCore allows
    GetParameter on "*": the read policy allows the monitoring node's instance and denies every
    other. Evaluated with every policy of the role (tooling/iampolicy.py, as AWS does), with the
    ARNs AWS would answer in place of the mocks' (labkit/aws/model.py, as the AWS lab reads it)."""
    from labkit.aws import iam, model
    from tooling import iampolicy

    result = _render(with_password())
    policy = result.named("monitoring-read")
    (role,) = [r for r in result.of_type("aws:iam/role:Role") if r.name == "gpu-node-role-role"]
    assert policy.inputs["role"] == role.outputs["name"]  # the nodes' role, the only one they have
    document = json.loads(policy.inputs["policy"])
    mock_arns = sorted(p.outputs["arn"] for p in _credentials(result).values())
    for statement in document["Statement"]:
        assert sorted(statement["Resource"]) == mock_arns
        master_arn = result.named("gpu-nodes-master").outputs["arn"]
        assert list(statement["Condition"].values()) == [{"ec2:SourceInstanceARN": master_arn}]

    stack = model.read(result, "us-west-2")
    name = stack.role_of_instance(stack.instances["master"])
    arns = sorted(p["arn"] for p in stack.parameters.values() if p["name"] in CREDENTIAL_NAMES)
    assert arns[0].startswith("arn:aws:ssm:us-west-2:")

    def reads(documents, node: str, action: str = "ssm:GetParameter") -> bool:
        instance = stack.instances[node].instance_id
        context = {"ec2:SourceInstanceARN": f"arn:aws:ec2:us-west-2:{model.ACCOUNT}:instance/{instance}"}
        principal = iampolicy.Principal(node, documents)
        return all(principal.evaluate(iampolicy.Request(action, (arn,), context)).allowed for arn in arns)

    documents = iam.documents_of_role(name, stack.role_policies[name], stack.role_attachments[name])
    assert reads(documents, "master")
    for action in READ_ACTIONS:
        assert not reads(documents, "worker-1", action), action
    # Without the monitoring policy the managed policy alone would let worker-1 read them.
    others = [text for text in stack.role_policies[name] if "MonitoringNodeReadsItsCredentials" not in text]
    assert reads(iam.documents_of_role(name, others, stack.role_attachments[name]), "worker-1")


def test_the_monitoring_nodes_first_run_waits_for_its_read_grant():
    result = _render(with_password())
    assert "monitoring-read" in result.named("monitoring-master").depends_on


class _VersionedMocks(offline.RecordingMocks):
    """The mocks, with a Parameter's `version` computed from its value as AWS raises it on a new
    value (a stand-in number: another value, another version)."""

    def new_resource(self, args):
        answer = super().new_resource(args)
        if args.typ == PARAMETER:
            value = json.dumps(args.inputs.get("value"), sort_keys=True, default=str)
            version = int(hashlib.sha256(value.encode()).hexdigest()[:6], 16) + 1
            answer[1]["version"] = self.resources[-1].outputs["version"] = version
        return answer


def test_a_new_password_is_a_new_version_in_the_association_and_updates_it_in_place(monkeypatch):
    monkeypatch.setattr(offline, "RecordingMocks", _VersionedMocks)
    before, after = _render(with_password(PASSWORD)), _render(with_password(ROTATED))
    _check_new_versions(before, after, {"monitoring-web-config", "monitoring-password"})
    again = _render(with_password(PASSWORD)).named("monitoring-master").inputs["parameters"]["SecretsVersion"]
    assert (
        again == before.named("monitoring-master").inputs["parameters"]["SecretsVersion"]
    )  # the same secrets


def test_a_new_certificate_is_a_new_version_in_the_association_and_updates_it_in_place(monkeypatch):
    monkeypatch.setattr(offline, "RecordingMocks", _VersionedMocks)
    before, after = _render(with_password()), _render(with_password(serial=2))
    _check_new_versions(before, after, {"monitoring-tls-certificate", "monitoring-tls-private-key"})


def _check_new_versions(before, after, parameters: set[str]):

    def carried(result):
        versions = [str(int(p.outputs["version"])) for p in _credentials(result).values()]
        return result.named("monitoring-master").inputs["parameters"]["SecretsVersion"], versions

    (old, old_versions), (new, new_versions) = carried(before), carried(after)
    assert sorted(old.split(",")) == sorted(old_versions) and sorted(new.split(",")) == sorted(new_versions)
    assert old != new
    moved = {c.name: c.action for c in changes.diff(before, after) if c.action != "same"}
    assert moved == {
        **{name: "update" for name in parameters},
        "monitoring-master": "update",  # in place: UpdateAssociation runs it again
    }
    # The containers' specs (their hashes decide a restart) are the same.
    unpacked = [
        monitoring_ssm.unpack(r.named("monitoring-master").inputs["parameters"]["Containers"])
        for r in (before, after)
    ]
    assert unpacked[0] == unpacked[1]
    summary = changes.rollout(before, after)
    assert summary.servers_restarted == [] and summary.nodes_replaced == []


def test_turning_tls_and_the_password_on_touches_the_monitoring_node_only():
    before, after = _render(open_monitoring(stackfile.read("dev"))), _render(with_password())
    moved = {c.name: c.action for c in changes.diff(before, after) if c.action != "same"}
    assert moved == {
        "monitoring-web-config": "create",
        "monitoring-password": "create",
        "monitoring-tls-certificate": "create",
        "monitoring-tls-private-key": "create",
        "monitoring-read": "create",
        "monitoring-master": "update",
    }


def test_the_server_files_script_with_credentials_passes_shellcheck(tmp_path):
    cluster = stackfile.validate(with_password(stack="prod"))
    text = monitoring_ssm.unpack(monitoring_ssm.parameters(cluster, "master", NODEMETRICS)["ServerFiles"])
    assert "aws ssm get-parameter" in text
    path = tmp_path / "files.sh"
    path.write_text(text)
    checked = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout
