"""required-paths: what must be open is open: the model port from the load balancer to every
target, the all-traffic self rules EFA needs, and the host-firewall paths of the port table.
"""

from __future__ import annotations

from collections.abc import Callable

from pulumi_policy import PolicyResource, ReportViolation, Severity, StackValidationArgs

from policies import normalized as net
from policies.declaration import MANDATORY, Settings, stack_policy
from policies.efa import uses_efa
from policies.facts import Net, current_facts
from policies.normalized import get
from policies.stack import Stack
from qwen_cluster.ports import Scope


@stack_policy(
    name="required-paths",
    description="The model port is reachable from the load balancer on every target; with EFA the node "
    "security group has all-traffic self rules in both directions.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Add an ingress rule on the node security group for the model port referencing the "
    "load balancer's security group; with EFA add ipProtocol -1 ingress and egress rules referencing the "
    "node security group itself.",
    config_schema={
        "efaSelfRules": {
            "type": "boolean",
            "default": True,
            "description": "Require the all-traffic self rules, in and out, on the node SG when EFA is used",
        }
    },
)
def required_paths(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    facts = current_facts()
    stack = Stack(args.resources)
    roles = stack.group_roles()
    rules = stack.rules()
    model = facts.model_port
    node_groups = sorted(name for name, role in roles.items() if role == "node" and name in stack.by_name)
    lb_groups = {name for name, role in roles.items() if role == "lb"}
    target_groups = stack.of_type(net.TARGET_GROUP)

    def admits_model_from_lb(group: str) -> bool:
        return any(
            r.direction == "ingress"
            and r.group == group
            and r.opens(model)
            and any(p.kind == "sg" and p.ref in lb_groups for p in r.peers)
            for r in rules
        )

    if target_groups or lb_groups:
        for group in stack.of_type(net.TARGET_GROUP):
            port = net.integral(get(group.props, "port"))
            if facts.known and port is not None and port != model:
                report(
                    f"target group {group.name} forwards to port {port}; the model listens on {model}",
                    group.urn,
                )
        if not lb_groups:
            report(
                f"no security group tagged {net.ROLE_TAG}={net.LB_SG}: no load balancer path to "
                + (f"{model}" if facts.known else "the model port")
            )
        instances = {n.name: n for n in stack.gpu_nodes() if n.resource_type == net.INSTANCE}
        targets: list[PolicyResource] = []
        for attachment in stack.of_type(net.TARGET_GROUP_ATTACHMENT):
            found = stack.resolve(attachment, "targetId", get(attachment.props, "targetId"), (net.INSTANCE,))
            if found in instances:
                targets.append(instances[found])
            port = net.integral(get(attachment.props, "port"))
            if facts.known and port is not None and port != model:
                report(
                    f"{attachment.name} registers port {port}; the model service listens on {model}",
                    attachment.urn,
                )
        # The model port comes from the stack's port table: without it, the path is not judged.
        for target in (targets or list(instances.values())) if facts.known else []:
            groups = stack.groups_of(target) or set(node_groups)
            if lb_groups and not any(admits_model_from_lb(g) for g in groups):
                report(
                    f"{target.name}: no security group of it ({', '.join(sorted(groups)) or 'none'}) admits "
                    f"{model}/tcp from the load balancer security group",
                    target.urn,
                )
        if not instances and lb_groups and facts.known:
            for group in node_groups:
                if not admits_model_from_lb(group):
                    owner = stack.by_name[group]
                    report(
                        f"{group} does not admit {model}/tcp from the load balancer security group", owner.urn
                    )

    if settings["efaSelfRules"] and node_groups and uses_efa(stack, facts):
        for group in node_groups:
            for direction in ("ingress", "egress"):
                if not any(
                    r.group == group
                    and r.direction == direction
                    and r.all_traffic
                    and any(p.kind == "self" for p in r.peers)
                    for r in rules
                ):
                    report(
                        f"{group} lacks the all-traffic {direction} rule referencing itself; EFA needs "
                        "all traffic between members of the node security group, in and out",
                        stack.by_name[group].urn,
                    )

    firewalls = stack.host_firewalls()
    if firewalls:
        lb_hosts = [doc for _, doc in firewalls if doc.load_balancer]
        if not lb_hosts:
            report("no host firewall is marked loadBalancer: nothing reaches the model service")
        lb_nets = [net.network(doc.address) for doc in lb_hosts if net.network(doc.address) is not None]
        addresses = {doc.host: net.network(doc.address) for _, doc in firewalls}
        cluster_spans = facts.spans(Scope.CLUSTER)
        # The paths of the port table: without the stack config, the table is not known.
        for resource, doc in firewalls if facts.known else []:
            inbound = [r for r in doc.rules if r.direction == "ingress"]

            def reaches(source: Net, port_check: Callable[[net.FirewallRule], bool], rules=inbound) -> bool:
                return any(
                    port_check(r)
                    and any(source.version == s.version and source.subnet_of(s) for s in r.sources)
                    for r in rules
                )

            # The load-balancer host reaches its own model server over loopback.
            is_target = (facts.heads is None or doc.host in facts.heads) and not doc.load_balancer
            opens_model = lambda r: r.protocol in ("all", "tcp") and (r.ports is None or model in r.ports)  # noqa: E731
            if is_target:
                for source in lb_nets:
                    if not reaches(source, opens_model):
                        report(
                            f"{doc.host}: the firewall does not admit {model}/tcp from the load balancer "
                            f"{source}",
                            resource.urn,
                        )
            for other, source in addresses.items():
                if other == doc.host or source is None:
                    continue
                for span in cluster_spans:

                    def opens_span(r, span=span):
                        return r.protocol in ("all", "tcp") and (
                            r.ports is None or (r.ports.low <= span.low and span.high <= r.ports.high)
                        )

                    if not reaches(source, opens_span):
                        report(
                            f"{doc.host}: the firewall does not admit {span}/tcp from node {other}",
                            resource.urn,
                        )
