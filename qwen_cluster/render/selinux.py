"""SELinux: never disabled, never `setenforce 0` (the guide's advice, refused). On a host
with SELinux on, the service ports get a port type confined services may bind instead.

Signatures:
    service_ports(cluster: ClusterConfig, node_name: str) -> list[str]   "5000", "8000", "80"
    apply_script(ports: list[str], *, port_type: str = PORT_TYPE,
                 state_dir: str = hostpaths.STATE_DIR) -> str    (/var/lib/qwen-cluster)
    revert_script(*, state_dir: str = hostpaths.STATE_DIR) -> str
"""

from __future__ import annotations

from qwen_cluster import hostpaths
from qwen_cluster.ports import Scope
from qwen_cluster.render.shell import quote, script

# Ports confined web servers (nginx's httpd_t, container_t) may bind and connect to.
PORT_TYPE = "http_port_t"


def service_ports(cluster, node_name: str) -> list[str]:
    ports = [str(entry.port) for entry in cluster.ports if entry.scope in (Scope.CLIENTS, Scope.MONITORING)]
    lb_node = cluster.load_balancer_node
    if lb_node is not None and lb_node.name == node_name:
        ports.append(str(cluster.load_balancer.port))
    return ports


def apply_script(
    ports: list[str], *, port_type: str = PORT_TYPE, state_dir: str = hostpaths.STATE_DIR
) -> str:
    wanted = "\n".join(ports)
    body = f"""
state={quote(state_dir)}/selinux-ports-added
if ! command -v getenforce >/dev/null || [ "$(getenforce)" = Disabled ]; then
  echo "selinux: not enabled on this host; nothing to label"
  exit 0
fi
echo "selinux: $(getenforce) (left as it is)"
if ! command -v semanage >/dev/null; then
  echo "selinux: FAILED: semanage is missing, so the service ports cannot be labelled;" \\
    "install policycoreutils-python-utils (RHEL) or policycoreutils-python-utils/semanage-utils" >&2
  exit 1
fi
mkdir -p "$(dirname "$state")"
touch "$state"
while IFS= read -r port; do
  [ -n "$port" ] || continue
  if semanage port -l | awk -v t={quote(port_type)} '$1 == t && $2 == "tcp"' | grep -qw -- "$port"; then
    echo "selinux: tcp/$port already {port_type}"
  elif semanage port -a -t {quote(port_type)} -p tcp "$port" 2>/dev/null; then
    echo "$port" >>"$state"
    echo "selinux: labelled tcp/$port {port_type}"
  elif semanage port -m -t {quote(port_type)} -p tcp "$port"; then
    echo "selinux: relabelled tcp/$port {port_type} (it had another type)"
  else
    echo "selinux: FAILED: cannot label tcp/$port as {port_type}" >&2
    exit 1
  fi
done <<'QWEN_PORTS_EOF'
{wanted}
QWEN_PORTS_EOF
"""
    return script("SELinux port labels (enforcing stays on)", body)


def revert_script(*, state_dir: str = hostpaths.STATE_DIR) -> str:
    body = f"""
state={quote(state_dir)}/selinux-ports-added
[ -e "$state" ] || exit 0
if command -v semanage >/dev/null; then
  sort -u "$state" | while IFS= read -r port; do
    semanage port -d -p tcp "$port" || true
  done
fi
rm -f "$state"
"""
    return script("remove the SELinux port labels qwen-cluster added", body)
