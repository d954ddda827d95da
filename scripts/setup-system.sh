#!/usr/bin/env bash
# Installs the Debian packages the tests and the lab run for real (nginx -t, shellcheck,
# network namespaces, firewalls, probes, promtool, Prometheus and its exporters, sshd and sudo
# for the lab's nodes, a Docker engine and registry). Skips what
# is already there; needs root for apt.
set -euo pipefail

# command -> Debian package
declare -A needed=(
  [nginx]=nginx
  [shellcheck]=shellcheck
  [ip]=iproute2
  [ping]=iputils-ping
  [iperf3]=iperf3
  [nft]=nftables
  [ufw]=ufw
  [dot]=graphviz
  [sysctl]=procps
  [wrk]=wrk
  # The lab reaches every node through its own sshd, as a non-root user with sudo.
  [sshd]=openssh-server
  [ssh]=openssh-client
  [sudo]=sudo
  # Monitoring: promtool/amtool check what is rendered; the lab runs them for real.
  [promtool]=prometheus
  [prometheus-alertmanager]=prometheus-alertmanager
  [prometheus-node-exporter]=prometheus-node-exporter
  [prometheus-blackbox-exporter]=prometheus-blackbox-exporter
  # A real Docker engine in every lab node's namespace (labkit/hosts/dockerd.py), Debian's registry as
  # the lab's Docker Hub mirror (labkit/hosts/registry.py), and a static busybox for the small images
  # the lab builds (labkit/images/build.py).
  # The package scripts do not start a daemon here (no init; policy-rc.d): the lab starts its own.
  [dockerd]=docker.io
  [docker-registry]=docker-registry
  [busybox]=busybox-static
  # The AWS lab (labkit/aws/): HAProxy stands in for the NLB; nsenter/unshare hold each node's
  # mounts.
  [haproxy]=haproxy
  [nsenter]=util-linux
)

missing=()
for cmd in "${!needed[@]}"; do
  if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1; then
    missing+=("${needed[$cmd]}")
  fi
done
# The AWS CLI the AWS lab's nodes run (labkit/aws/): Debian's v2 at /usr/bin/aws, as the node
# scripts find it on PATH; another `aws` earlier on a developer's PATH (pip, pyenv) does not count.
if [ ! -x /usr/bin/aws ]; then
  missing+=(awscli)
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-system: missing ${missing[*]} (install them as root with apt-get); tests that need them will say so" >&2
  exit 0
fi
echo "setup-system: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends keeps ufw/nginx from pulling in services we start ourselves.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
