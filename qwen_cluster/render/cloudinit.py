"""First-boot script for a GPU node (EC2 user data, run once by cloud-init): machine-level
setup only.

It lives in the launch template, and a launch template change is a new version, which
replaces the instance (terraform-provider-aws internal/service/ec2/ec2_instance.go, the
CustomizeDiff on launch_template.0.version). So it holds only what is the machine's: the
cluster interface's MTU and the EFA check. The model server, its environment and the sysctl
tuning arrive through SSM (qwen_cluster/render/ssm.py), whose changes roll without replacing a
machine. A shell script rather than #cloud-config so that it can be checked with `bash -n`.
It carries no secret: user data is readable through IMDS.
"""

from __future__ import annotations

from qwen_cluster.config import ClusterConfig
from qwen_cluster.render.shell import INTERFACE_OF, interface_of_function

# Jumbo frames inside a VPC (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/network_mtu.html).
CLUSTER_MTU = 9001
# The DLAMI installs libfabric and the aws-ofi-nccl plugin under /opt/amazon.
EFA_FI_INFO = "/opt/amazon/efa/bin/fi_info"
# EC2 refuses user data above 16 KB (before base64).
USER_DATA_LIMIT = 16 * 1024


def user_data(cluster: ClusterConfig, node_name: str) -> str:
    """The node's first-boot script: MTU on the cluster interface, the EFA check."""
    node = next(node for node in cluster.nodes if node.name == node_name)
    ip = str(node.ip)
    efa = bool(cluster.aws and cluster.aws.efa)
    lines = [
        "#!/bin/bash",
        f"# qwen-cluster first boot: {node_name} ({ip}). The model server arrives through SSM.",
        "set -euo pipefail",
        f"NODE_IP={ip}",
        "",
        "# The cluster interface is the one holding the node's static IP.",
        # The one finder (qwen_cluster/node/nic.py through shell.interface_of_function), not a
        # copy of its own: it prints exactly one interface (two lines would break `ip link set`).
        # Its text is part of the user data, so changing it is a new launch-template version,
        # which replaces every GPU instance on that `up` (tooling/changes/rules.py, the
        # launch template's and the instance's rules).
        interface_of_function(),
        f'IFACE=$({INTERFACE_OF} "$NODE_IP")',
        'if [ -z "$IFACE" ]; then echo "no interface holds $NODE_IP" >&2; exit 1; fi',
        f'ip link set dev "$IFACE" mtu {CLUSTER_MTU}',
    ]
    if efa:
        lines += [
            "",
            "# EFA must be up before NCCL starts, or it silently falls back to TCP sockets.",
            f"if ! {EFA_FI_INFO} -p efa -t FI_EP_RDM; then echo 'EFA provider not available' >&2; exit 1; fi",
        ]
    script = "\n".join(lines) + "\n"
    if len(script.encode()) > USER_DATA_LIMIT:
        raise ValueError(f"user data for {node_name} is {len(script.encode())} bytes; EC2 takes 16 KB")
    return script
