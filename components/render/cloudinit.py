"""First-boot script for a GPU node (EC2 user data, run once by cloud-init).

A shell script rather than #cloud-config so that it can be checked with `bash -n` and
shellcheck. It carries no secret: EC2 user data is readable by anyone on the instance
through IMDS and by anyone with ec2:DescribeInstanceAttribute.
"""

from __future__ import annotations

import shlex

from components.config import ClusterConfig
from components.render import vllm
from components.render.sysctl import DROPIN_PATH, dropin

# Jumbo frames inside a VPC (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/network_mtu.html).
CLUSTER_MTU = 9001
# The DLAMI installs libfabric and the aws-ofi-nccl plugin under /opt/amazon.
EFA_FI_INFO = "/opt/amazon/efa/bin/fi_info"
EFA_LIBRARY_PATH = "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib"
CONTAINER_NAME = "qwen-vllm"
ENV_FILE = "/etc/qwen-cluster/model-server.env"
HF_CACHE = "/opt/qwen-cluster/huggingface"
# EC2 refuses user data above 16 KB (before base64).
USER_DATA_LIMIT = 16 * 1024


def user_data(cluster: ClusterConfig, node_name: str) -> str:
    """The node's first-boot script: sysctl drop-in, MTU, EFA check, the model server."""
    node = next(node for node in cluster.nodes if node.name == node_name)
    ip = str(node.ip)
    topology = cluster.topology
    replica = topology.replica_of(node_name)
    efa = bool(cluster.aws and cluster.aws.efa)
    role = "head" if replica.head.name == node_name else "worker"
    env = {**vllm.environment(cluster, node_name), "HF_HOME": "/root/.cache/huggingface"}
    if efa:
        env |= {"FI_PROVIDER": "efa", "LD_LIBRARY_PATH": EFA_LIBRARY_PATH}
    docker = [
        "--detach", f"--name={CONTAINER_NAME}", "--restart=unless-stopped",
        "--gpus=all", "--network=host", "--ipc=host", "--ulimit=memlock=-1",
        f"--env-file={ENV_FILE}", f"--volume={HF_CACHE}:/root/.cache/huggingface",
    ]  # fmt: skip
    if efa:
        docker += ["--device=/dev/infiniband", "--volume=/opt/amazon:/opt/amazon:ro"]
    docker += ["--entrypoint=/bin/bash", cluster.model.image, "-c", vllm.server_script(cluster, node_name)]

    lines = [
        "#!/bin/bash",
        f"# qwen-cluster first boot: {node_name} ({ip}), replica {replica.index} {role}.",
        "set -euo pipefail",
        f"NODE_IP={ip}",
        "",
        "# Kernel tuning from tuning.sysctl, as a drop-in (never appended to sysctl.conf).",
        f"install -d -m 0755 {shlex.quote(DROPIN_PATH.rsplit('/', 1)[0])}",
        f"cat > {DROPIN_PATH} <<'SYSCTL'",
        dropin(cluster.tuning.sysctl).rstrip("\n"),
        "SYSCTL",
        "sysctl --system",
        "",
        "# The cluster interface is the one holding the node's static IP.",
        "IFACE=$(ip -o -4 addr show | "
        'awk -v ip="$NODE_IP" \'{split($4, a, "/"); if (a[1] == ip) print $2}\')',
        'if [ -z "$IFACE" ]; then echo "no interface holds $NODE_IP" >&2; exit 1; fi',
        f'ip link set dev "$IFACE" mtu {CLUSTER_MTU}',
    ]
    if efa:
        lines += [
            "",
            "# EFA must be up before NCCL starts, or it silently falls back to TCP sockets.",
            f"if ! {EFA_FI_INFO} -p efa -t FI_EP_RDM; then echo 'EFA provider not available' >&2; exit 1; fi",
        ]
    lines += [
        "",
        "# The model server's environment; NCCL and Gloo talk over the cluster interface only.",
        f"install -d -m 0755 {ENV_FILE.rsplit('/', 1)[0]} {HF_CACHE}",
        f"cat > {ENV_FILE} <<ENV",
        *(f"{key}={value}" for key, value in env.items()),
        "NCCL_SOCKET_IFNAME=$IFACE",
        "GLOO_SOCKET_IFNAME=$IFACE",
        "ENV",
        "",
        f"docker rm --force {CONTAINER_NAME} >/dev/null 2>&1 || true",
        "docker run \\\n  " + " \\\n  ".join(shlex.quote(part) for part in docker),
        "",
    ]
    script = "\n".join(lines)
    if len(script.encode()) > USER_DATA_LIMIT:
        raise ValueError(f"user data for {node_name} is {len(script.encode())} bytes; EC2 takes 16 KB")
    return script
