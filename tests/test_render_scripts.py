"""RDMA, SELinux, preflight and verify scripts."""

import os
import subprocess

import pytest

from qwen_cluster.node import nic, nodemetrics
from qwen_cluster.render import cloudinit, collective, nodecheck, preflight, rdma, selinux, shell, ssm, verify
from qwen_cluster.render.verify import Pair, Probe
from tests.helpers import tools
from tests.helpers.baremetal import ONPREM, needs_netns, netns_pair, run_in, shellcheck
from tests.helpers.wait import wait_until
from tooling import stackfile


def test_rdma_installs_the_guides_packages_and_requires_a_device():
    text = rdma.apply_script(required=True)
    assert "libibverbs1 ibverbs-utils rdma-core" in text
    assert "libibverbs libibverbs-utils rdma-core" in text
    assert "ibv_devices" in text and "lists no RDMA device" in text


def test_rdma_off_changes_nothing():
    text = rdma.apply_script(required=False)
    assert "apt-get" not in text and "dnf" not in text


def test_selinux_labels_ports_and_never_disables():
    text = selinux.apply_script(selinux.service_ports(ONPREM, "master"))
    assert "semanage port -a -t http_port_t" in text
    assert "setenforce" not in text and "SELINUX=disabled" not in text
    assert "5000\n8000\n9090\n9093\n80\n" in text
    assert selinux.service_ports(ONPREM, "worker-1") == ["5000", "8000", "9090", "9093"]


def test_preflight_checks_speed_against_both_floors():
    text = preflight.for_node(ONPREM, "worker-1")
    assert "node_ip=192.168.1.101" in text
    assert "min_gbps=10" in text and "declared_gbps=25" in text
    assert "NTPSynchronized" in text


@pytest.mark.parametrize(
    "text",
    [
        rdma.apply_script(required=True),
        rdma.revert_script(),
        selinux.apply_script(["5000", "80"]),
        selinux.revert_script(),
        preflight.for_node(ONPREM, "master"),
        verify.for_cluster(ONPREM, min_bandwidth_gbps=10),
    ],
    ids=["rdma", "rdma-revert", "selinux", "selinux-revert", "preflight", "verify"],
)
def test_scripts_are_shellcheck_clean(text, tmp_path):
    shellcheck(text, tmp_path)


def test_cluster_probes_cover_every_ordered_pair():
    probes = verify.cluster_probes(ONPREM)
    pairs = {(p.source, p.dest) for p in probes}
    assert len(pairs) == 4 * 3
    model = [p for p in probes if p.name == "model-service"]
    assert {p.expect for p in model} == {"service"}  # every node heads a replica
    listener = [p for p in probes if p.name == "listener"]
    assert {p.dest for p in listener} == {"master"} and {p.port for p in listener} == {80}
    assert {(p.port, p.expect) for p in probes if p.name == "inter-node"} == {
        (6000, "reachable"),
        (6100, "reachable"),
    }


def test_verify_embeds_the_latency_budget():
    assert "max_latency_ms=1" in verify.for_cluster(ONPREM)


@needs_netns
def test_preflight_in_a_namespace_prints_the_numbers(tmp_path):
    with netns_pair() as (a, _):
        ok = run_in(
            a,
            preflight.apply_script(
                "10.231.0.1", min_bandwidth_gbps=10, declared_gbps=None, check_time_sync=False
            ),
            tmp_path,
        )
        assert ok.returncode == 0, ok.stderr
        assert "speed 10000 Mbit/s" in ok.stdout
        slow = run_in(
            a,
            preflight.apply_script(
                "10.231.0.1", min_bandwidth_gbps=10, declared_gbps=25, check_time_sync=False
            ),
            tmp_path,
        )
        assert slow.returncode == 1
        assert "10000 Mbit/s is below the declared bareMetal.nicSpeedGbps 25" in slow.stderr
        missing = run_in(
            a, preflight.apply_script("10.231.0.77", min_bandwidth_gbps=10, declared_gbps=None), tmp_path
        )
        assert missing.returncode == 1 and "no interface holds 10.231.0.77" in missing.stderr


DROP_7002 = (
    "add table inet t; add chain inet t in { type filter hook input priority 0; policy accept; }; "
    "add rule inet t in tcp dport 7002 drop"
)
# Listens until killed (the kernel completes the handshakes; nothing need accept them).
LISTEN_7001 = (
    "import signal,socket; s=socket.socket(); s.bind(('10.231.0.2',7001)); s.listen(); signal.pause()"
)


def listening(namespace: str, port: int) -> bool:
    found = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-H", "-ltn", f"sport = :{port}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return bool(found.stdout.strip())


@needs_netns
@tools.needs("nft", "ss")
def test_verify_prints_the_matrix_and_names_failing_pairs(tmp_path):
    row = ("a", "10.231.0.1", "b", "10.231.0.2")
    probes = [
        Probe(*row, "listening", 7001, "service"),
        Probe(*row, "no-listener", 7004, "reachable"),
        Probe(*row, "dropped", 7002, "closed"),
        Probe(*row, "wrongly-open", 7003, "closed"),
        Probe("b", "10.231.0.2", "a", "10.231.0.1", "not-from-here", 7001, "service"),
    ]
    text = verify.apply_script(probes, [Pair(*row)], max_latency_ms=5.0)
    with netns_pair() as (a, b):
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                b,
                "nft",
                DROP_7002,
            ],
            check=True,
        )
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                b,
                "python3",
                "-c",
                LISTEN_7001,
            ]
        )
        try:
            wait_until(lambda: listening(b, 7001), what="the listener on 10.231.0.2:7001", timeout=10)
            result = run_in(a, text, tmp_path)
        finally:
            server.kill()
    out = result.stdout
    assert result.returncode == 1
    assert "listening" in out and "not-from-here" not in out
    lines = {line.split()[2]: line.split() for line in out.splitlines() if line.startswith("a ")}
    assert lines["listening"][5:] == ["open", "ok"]
    assert lines["no-listener"][5:] == ["refused", "ok"]
    assert lines["dropped"][5:] == ["filtered", "ok"]
    assert lines["wrongly-open"][5:] == ["refused", "FAIL"]
    assert "a->b wrongly-open 7003/tcp: expected closed, got refused" in result.stderr
    assert "dropped" not in result.stderr


FAKE_IP = """#!/bin/sh
echo "2: eth0    inet 10.0.0.1/24 brd 10.0.0.255 scope global eth0"
"""


# `timeout SECONDS bash -c ...` as the probe calls it: records its seconds; the first call per
# port gives up as a timeout does (exit 124, nothing said), every later one connects.
FLAKY_TIMEOUT = """#!/bin/sh
echo "$1 $6" >>"$CALLS"
if grep -qx "$6" "$SEEN" 2>/dev/null; then exit 0; fi
echo "$6" >>"$SEEN"
exit 124
"""


def test_verify_asks_a_port_that_must_answer_once_more_with_more_time_and_a_closed_one_once(tmp_path):
    """A probe's timeout also covers starting its bash: on a busy host one start took over the
    lab's 1 s, and a reachable port read as filtered. Only a failure pays the second ask."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"ip": FAKE_IP, "ping": "#!/bin/sh\nexit 1\n", "timeout": FLAKY_TIMEOUT}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    row = ("a", "10.0.0.1", "b", "10.0.0.2")
    probes = [Probe(*row, "slow-start", 7001, "reachable"), Probe(*row, "dropped", 7002, "closed")]
    script = tmp_path / "verify.sh"
    script.write_text(verify.apply_script(probes, [], max_latency_ms=1.0, connect_timeout_seconds=1))
    calls = tmp_path / "calls"
    done = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "SEEN": str(tmp_path / "seen")},
    )
    lines = {line.split()[2]: line.split() for line in done.stdout.splitlines() if line.startswith("a ")}
    assert lines["slow-start"][5:] == ["open", "ok"]
    assert lines["dropped"][5:] == ["filtered", "ok"]
    assert calls.read_text().splitlines() == ["1 7001", "3 7001", "1 7002"]
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("replies", "passes", "shown"),
    [
        (["0.081", "9.70", "0.090", "0.072", "0.101"], True, "0.090"),  # one late reply (ARP, a busy host)
        (["1.6", "0.2", "1.8", "2.1", "0.3"], False, "1.6"),  # three of five over: the link is slow
        (["0.4", "0.3", "1.2", "0.2"], True, "0.3"),  # a reply lost: the median of those that came
        ([], False, "-"),
    ],
)
def test_verify_holds_the_median_ping_rtt_to_the_latency_budget(tmp_path, replies, passes, shown):
    """The verify script's latency row: ping's own output lines, parsed by the script."""
    lines = "".join(
        f"echo '64 bytes from 10.0.0.2: icmp_seq={n} ttl=64 time={rtt} ms'\n"
        for n, rtt in enumerate(replies, 1)
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"ip": FAKE_IP, "ping": f"#!/bin/sh\n{lines}exit {0 if replies else 1}\n"}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "verify.sh"
    script.write_text(verify.apply_script([], [Pair("a", "10.0.0.1", "b", "10.0.0.2")], max_latency_ms=1.0))
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}
    )
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("a "))
    assert row == ["a", "b", shown, "ok" if passes else "FAIL"]
    assert done.returncode == (0 if passes else 1)
    if not passes and replies:
        assert f"a->b ping: median RTT {shown} ms is above maxLatencyMs 1" in done.stderr


def _scaled_onprem(count: int):
    from qwen_cluster import config
    from tooling import bench, stackfile

    return config.validate(stackfile.cluster_keys(bench.scaled_stack("onprem", count)))


def test_every_registered_command_fits_in_the_one_argument_sshd_passes_to_bash():
    """At 24 nodes (the whole matrix in every node's verify script passed the limit at 17)."""
    from qwen_cluster.render.shell import MAX_ARG_STRLEN
    from tooling import bench, offline

    render = offline.render(bench.scaled_stack("onprem", 24), "onprem")
    assert render.error is None
    sizes = {
        (resource.name, key): len(text.encode())
        for resource in render.of_type("command:remote:Command")
        for key in ("create", "update", "delete")
        if isinstance(text := resource.inputs.get(key), str)
    }
    assert len({name for name, _ in sizes}) > 24 * 5
    assert max(sizes.values()) < MAX_ARG_STRLEN, max(sizes.items(), key=lambda item: item[1])
    # Each node's verify holds its own rows only.
    text = render.named("worker-7-verify").inputs["create"]
    sources = [line for line in text.splitlines() if line.startswith("@")]
    assert sources == ["@worker-7|192.168.1.11"] * 2  # its probes, its pings


def test_a_nodes_verify_script_holds_exactly_its_own_probes_and_pings():
    """Each destination's rows are written once per cluster and joined per node: the same
    script as from that node's probes and pairs."""
    cluster = _scaled_onprem(9)
    for node in cluster.nodes:
        expected = verify.apply_script(
            verify.cluster_probes(cluster, node.name),
            verify.cluster_pairs(cluster, node.name),
            max_latency_ms=cluster.network.max_latency_ms,
            service_wait_seconds=600,
            node_section=nodecheck.section(cluster, node.name),
        )
        assert verify.for_cluster(cluster, node.name, service_wait_seconds=600) == expected


def test_one_nodes_verify_script_fits_at_256_nodes():
    from qwen_cluster.render.shell import MAX_ARG_STRLEN

    cluster = _scaled_onprem(256)
    text = verify.for_cluster(cluster, "worker-200", service_wait_seconds=1800)
    probes = [line for line in text.splitlines() if line.endswith(("|service", "|reachable"))]
    # SSH, both ends of three table ranges, one dynamic port per peer, and the listener
    assert len(probes) == len(verify.cluster_probes(cluster, "worker-200")) == 255 * 8 + 1
    assert len(text.encode()) < MAX_ARG_STRLEN


def test_a_verify_script_too_long_for_sshd_is_refused_when_rendered():
    cluster = _scaled_onprem(400)
    with pytest.raises(ValueError, match=r"the verify script of worker-9 is \d+ bytes, over the 131072"):
        verify.for_cluster(cluster, "worker-9")


def _interface_from_bash(ip: str) -> str:
    text = f'{shell.interface_of_function()}\n{shell.INTERFACE_OF} "$1"\n'
    return subprocess.run(["bash", "-c", text, "bash", ip], capture_output=True, text=True, check=True).stdout


def _interface_from_container(ip: str) -> str:
    """What the model container's prelude runs (it has Python, not iproute2)."""
    env = {**os.environ, **collective.finder_environment(), "VLLM_HOST_IP": ip}
    text = 'python3 -c "$QWEN_FIND_INTERFACE" "$VLLM_HOST_IP"'
    found = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    return found.stdout


def _interface_from_iproute2(ip: str) -> str:
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    for line in listed.stdout.splitlines():
        words = line.split()
        if words[3].split("/")[0] == ip:
            return words[1] + "\n"
    return ""


def test_the_host_the_container_and_the_endpoint_find_the_interface_iproute2_names():
    """One finder (qwen_cluster/node/nic.py) everywhere: for every IPv4 address of this host the
    host scripts, the model container and the monitoring endpoint name the NIC `ip -o -4 addr
    show` lists first, and for an address no interface holds none of them names one."""
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True)
    addresses = [line.split()[3].split("/")[0] for line in listed.stdout.splitlines()]
    assert "127.0.0.1" in addresses
    for ip in [*addresses, "192.0.2.77"]:
        expected = _interface_from_iproute2(ip)
        assert _interface_from_bash(ip) == _interface_from_container(ip) == expected, ip
        assert (nodemetrics.nic_of(ip) or "") == expected.strip(), ip


def test_no_renderer_spells_the_finder_again():
    """The finder's text lives in nic.py alone: the user data, the SSM run, the preflight and
    the container all carry that text, none a copy of their own."""
    for text in (
        cloudinit.user_data(stackfile.load("dev"), "worker-1"),
        ssm.run_script(),
        preflight.for_node(stackfile.load("onprem"), "master"),
    ):
        assert nic.FINDER.rstrip() in text
        assert "fcntl.ioctl" not in text and "awk -v ip=" not in text


def test_the_interface_finder_is_shellcheck_clean(tmp_path):
    body = f'{shell.interface_of_function()}\n{shell.INTERFACE_OF} "$1"'
    shellcheck(shell.script("interface finder", body), tmp_path)


@needs_netns
def test_the_finder_names_the_nic_of_a_secondary_address_as_iproute2_does(tmp_path):
    """SIOCGIFADDR, used before, saw only an interface's primary address; rtnetlink sees all."""
    with netns_pair() as (a, _):
        nic_name = next(
            line.split()[1]
            for line in subprocess.run(
                ["ip", "-n", a, "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
            if "10.231.0.1/" in line
        )
        subprocess.run(["ip", "-n", a, "addr", "add", "10.231.0.9/24", "dev", nic_name], check=True)
        text = f'{shell.interface_of_function()}\n{shell.INTERFACE_OF} "$1"\n'
        for address in ("10.231.0.1", "10.231.0.9"):
            assert run_in(a, text, tmp_path, address).stdout == f"{nic_name}\n"
        assert run_in(a, text, tmp_path, "10.231.0.77").stdout == ""
