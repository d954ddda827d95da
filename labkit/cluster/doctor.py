"""doctor against the lab: tooling/doctor.py, asking the lab's Prometheus and nodes from inside
the lab (its namespaces have no route to the host). scripts/doctor.py runs `main`."""

from __future__ import annotations

from labkit.cluster import blueprint, lifecycle
from labkit.engine import executor, substitutions
from labkit.hosts import netns
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render.monitoring import prometheus
from tooling import doctor, stackfile


def lab_plan_of(stack: str, label: str | None) -> blueprint.LabPlan:
    """The lab as last applied, as `lab.py upgrade` reads it (labkit/cluster/upgrade.py changed_config):
    the config in its applied state, so a lab brought up with `--nodes N`, or changed since,
    is checked as it runs. The stack file's plan for a lab never applied."""
    lab_plan = blueprint.load(stack, label=label)
    state = executor.load_state(lifecycle.state_file(lab_plan))
    return lifecycle.plan_from_config(state.config, lab_plan.label) if state is not None else lab_plan


def lab_fetch(stack: str, label: str | None) -> tuple[doctor.Fetch, str]:
    """A fetch that asks the lab's Prometheus from inside its node's namespace, and its URL."""
    lab_plan = lab_plan_of(stack, label)
    cluster = lab_plan.cluster
    if cluster.monitoring_node is None:
        raise doctor.Unreachable(f"stack {stack} has monitoring.prometheus off: no Prometheus in its lab")
    member = lab_plan.node(cluster.monitoring_node.name)
    if not netns.exists(member.namespace):
        raise doctor.Unreachable(f"lab {lab_plan.label} is not up (no namespace {member.namespace})")
    url, inner = monitoring_fetch(lab_plan)
    return (lambda path: netns.call_in(member.namespace, inner, path)), f"{url} (lab {lab_plan.label})"


def monitoring_url(lab_plan: blueprint.LabPlan, port: int | None = None) -> str:
    """Where the lab's Prometheus (or, with `port`, Alertmanager) answers: over https, since the
    lab gives every stack with Prometheus monitoring.tls from its CA (labkit/engine/substitutions.py)."""
    cluster = lab_plan.cluster
    return f"https://{cluster.monitoring_node.ip}:{port or prometheus.prometheus_port(cluster)}"


def monitoring_fetch(lab_plan: blueprint.LabPlan, timeout: float = 5.0) -> tuple[doctor.Fetch, str]:
    """(the URL, doctor's fetch of the lab's Prometheus): logged in with the lab's password and
    verifying the lab's CA alone, as doctor does a stack's (monitoring.tls.caCertificate). Call
    the fetch inside a lab namespace."""
    url = monitoring_url(lab_plan)
    identity = lifecycle.endpoint_identity(lab_plan)
    fetch = doctor.http_fetch(
        url, timeout=timeout, password=monitoring_password(lab_plan), ca_certificate=identity.ca_certificate
    )
    return url, fetch


def monitoring_password(lab_plan: blueprint.LabPlan) -> str | None:
    """The password the lab's Prometheus asks for: the lab gives every stack with Prometheus its
    own, on both targets (labkit/engine/substitutions.py endpoint_secrets); None without one.
    A rotation test's password is its own to know."""
    cluster = lab_plan.cluster
    if cluster.monitoring_node is None:
        return None
    return lifecycle.endpoint_identity(lab_plan).monitoring_password or None


def lab_runner(stack: str, label: str | None) -> tuple[doctor.Runner, ClusterConfig]:
    """The runner for the lab of `stack` (`label`), and the config it deployed."""
    return plan_runner(lab_plan_of(stack, label))


def plan_runner(lab_plan: blueprint.LabPlan, purpose: str = "doctor") -> tuple[doctor.Runner, ClusterConfig]:
    """Each lab node runs the script in its namespace as root, with the environment its sshd
    gives a session (the lab's docker on PATH, its dockerd as DOCKER_HOST): what `pulumi up`'s
    commands see there. With it, the config the lab deployed (the stack with the lab's
    substitutions, e.g. no RDMA in a namespace): what the nodes' checks must be rendered from.
    `purpose` names the script's file in the lab's state directory."""
    options = lifecycle.Options()
    raw, _ = substitutions.stack_config(lifecycle.stack_config(lab_plan), options.clock_scale)
    deployed = stackfile.validate(raw)

    def run(node: str, text: str) -> tuple[int, str]:
        member = lab_plan.node(node)
        if not netns.exists(member.namespace):
            return 2, f"lab {lab_plan.label} is not up (no namespace {member.namespace})"
        path = lifecycle.state_dir(lab_plan) / f"{node}.{purpose}.sh"
        path.write_text(text)
        env = lifecycle.session_env(lifecycle.host(lab_plan, member, options))
        argv = ["env", *(f"{key}={value}" for key, value in env.items()), "bash", str(path)]
        done = netns.exec_in(member.namespace, argv, check=False, timeout=120)
        return done.returncode, done.stdout + done.stderr

    return run, deployed


LAB = doctor.Lab(fetch=lab_fetch, runner=lab_runner)


def main(argv: list[str] | None = None) -> int:
    return doctor.main(argv, lab=LAB)
