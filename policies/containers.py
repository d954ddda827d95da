"""container-host-network: on bare metal every container runs on the host's network and publishes
no port. A published port (`docker run -p`, the Docker provider's `ports`) is a DNAT rule in
docker's own nat/FORWARD chains, which the kernel consults before the INPUT chain where ufw,
firewalld and nftables host rules sit: such a port is open to whoever reaches the host, whatever
the host firewall says (docs.docker.com/engine/network/packet-filtering-firewalls/, "Docker and
ufw"). A container on a bridge network is reached the same way. So the pack refuses both.
"""

from __future__ import annotations

from pulumi_policy import ReportViolation, ResourceValidationArgs, Severity

from policies.declaration import MANDATORY, Settings, resource_policy
from policies.normalized import UNKNOWN, get, integral, items

CONTAINER = "docker:index/container:Container"


def _published(entry) -> str:
    external = integral(get(entry, "external"))
    internal = integral(get(entry, "internal"))
    protocol = str(get(entry, "protocol", default="tcp"))
    address = get(entry, "ip", default="0.0.0.0")
    host_side = f"{address}:{external}" if external is not None else f"{address}:<any>"
    return f"{host_side}->{internal if internal is not None else '?'}/{protocol}"


@resource_policy(
    name="container-host-network",
    description="Bare-metal containers run on host networking and publish no port: docker's NAT "
    "chains would let a published port past the host firewall.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Set network_mode='host' and drop `ports` (the service binds the node's address, "
    "and the host firewall rendered from the port table decides who reaches it).",
)
def container_host_network(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    if args.resource_type != CONTAINER:
        return
    for index, entry in enumerate(items(args.props, "ports")):
        report(
            f"ports[{index}] publishes {_published(entry)}: docker's NAT rules bypass the host firewall; "
            "run on the host network instead"
        )
    mode = get(args.props, "networkMode")
    if mode is UNKNOWN:
        return
    if mode is None or str(mode).strip().lower() != "host":
        report(
            f"networkMode is {mode or 'unset (docker default: bridge)'}; containers run with "
            "networkMode host, where the host firewall applies"
        )
    for index, network in enumerate(items(args.props, "networksAdvanced")):
        report(f"networksAdvanced[{index}] ({get(network, 'name', default='?')}) attaches a docker network")
