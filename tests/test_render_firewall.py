import contextlib
import copy
import ipaddress
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import normalized as net
from qwen_cluster import config
from qwen_cluster.config import validate
from qwen_cluster.render import firewall
from qwen_cluster.render.firewall import Rule
from tests.helpers import tools
from tests.helpers.baremetal import ONPREM, ONPREM_DISAGGREGATED, needs_netns, netns_pair, run_in, shellcheck
from tests.helpers.configs import BASE_BARE_METAL, disaggregated
from tests.helpers.wait import wait_until
from tooling import stackfile


def rules_of(node: str) -> list[Rule]:
    return firewall.host_rules(ONPREM, node)


def sources(rules: list[Rule], name: str) -> set[str]:
    return {rule.source for rule in rules if rule.name == name}


def test_prometheus_and_alertmanager_ports_open_only_on_the_monitoring_node():
    assert ONPREM.monitoring_node.name == "master"
    assert {rule.ports for rule in rules_of("master")} >= {"9090", "9093"}
    for worker in ("worker-1", "worker-2", "worker-3"):
        opened = {rule.ports for rule in rules_of(worker) if rule.source != "192.168.1.100/32"}
        assert not opened & {"9090", "9093"}, worker
    assert {rule.name for rule in rules_of("worker-1")} >= {"monitoring"}


def test_ssh_from_admin_cidrs_comes_first():
    rules = rules_of("worker-1")
    assert rules[0] == Rule("ssh", "203.0.113.10/32", "22", "tcp")


def test_policy_document_carries_exactly_the_rendered_rules():
    rules = rules_of("worker-1")
    document = firewall.policy_document(ONPREM, "worker-1", rules)
    assert document["schema"] == net.FIREWALL_SCHEMA
    assert [(r["sources"], r["ports"], r["protocol"]) for r in document["rules"]] == [
        ([rule.source], None if rule.ports == "all" else rule.ports, rule.protocol) for rule in rules
    ]
    assert all(
        r["action"] == "allow" and r["direction"] == "in" and r["description"] for r in document["rules"]
    )
    (parsed,) = net.firewall_documents({"triggers": ["a script hash", document]})
    assert (parsed.host, parsed.address, parsed.nic_speed_gbps, parsed.load_balancer) == (
        "worker-1",
        "192.168.1.101",
        25,
        False,
    )
    assert len(parsed.rules) == len(rules) and parsed.problems == ()


def test_policy_document_marks_the_load_balancer_host_and_its_listener():
    document = firewall.policy_document(ONPREM, "master", rules_of("master"))
    assert (document["loadBalancer"], document["listenerPort"]) == (True, ONPREM.load_balancer.port)


def test_cluster_scope_admits_the_other_nodes_exact_addresses_not_the_segment():
    rules = rules_of("worker-1")
    # .100 alone, .102-.103 as one exact block: the same three addresses.
    assert sources(rules, "cluster-all") == {"192.168.1.100/32", "192.168.1.102/31"}
    assert {r.ports for r in rules if r.name == "cluster-all"} == {"all"}
    intruder = ipaddress.ip_address("192.168.1.50")
    assert not any(intruder in ipaddress.ip_network(rule.source) for rule in rules)


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(min_value=4, max_value=250), min_size=2, max_size=40))
def test_member_blocks_hold_exactly_the_other_nodes(last_octets):
    octets = sorted(last_octets)
    raw = copy.deepcopy(BASE_BARE_METAL)
    raw["nodes"] = [
        {"name": f"n{o}", "ip": f"192.168.1.{o}", **({"role": "master"} if i == 0 else {})}
        for i, o in enumerate(octets)
    ]
    cluster = validate(raw)
    me = cluster.nodes[len(octets) // 2]
    blocks = [
        ipaddress.ip_network(r.source)
        for r in firewall.host_rules(cluster, me.name)
        if r.name == "cluster-all"
    ]
    covered = {address for block in blocks for address in block}
    assert covered == {node.ip for node in cluster.nodes if node.name != me.name}
    assert len(blocks) <= len(octets) - 1


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(min_value=4, max_value=250), min_size=2, max_size=40), st.data())
def test_member_blocks_are_the_fewest_blocks_that_hold_the_other_nodes(last_octets, data):
    """The cluster is collapsed once and each node cut out of it: the same blocks as
    collapsing every other node's address for that node."""
    octets = sorted(last_octets)
    raw = copy.deepcopy(BASE_BARE_METAL)
    raw["nodes"] = [
        {"name": f"n{o}", "ip": f"192.168.1.{o}", **({"role": "master"} if i == 0 else {})}
        for i, o in enumerate(octets)
    ]
    cluster = validate(raw)
    me = data.draw(st.sampled_from(cluster.nodes))
    blocks = [r.source for r in firewall.host_rules(cluster, me.name) if r.name == "cluster-all"]
    others = (ipaddress.ip_network(f"{node.ip}/32") for node in cluster.nodes if node.name != me.name)
    assert blocks == [str(block) for block in ipaddress.collapse_addresses(others)]


def test_clients_port_only_from_the_load_balancer_node():
    assert [(r.source, r.ports) for r in rules_of("worker-2") if r.name == "model-service"] == [
        ("192.168.1.100/32", "5000")
    ]
    # On the LB node itself nginx reaches its local model server over loopback.
    assert sources(rules_of("master"), "model-service") == set()


def test_listener_only_on_the_load_balancer_node_from_client_cidrs():
    assert [(r.source, r.ports) for r in rules_of("master") if r.name == "listener"] == [("10.0.0.0/8", "80")]
    assert sources(rules_of("worker-1"), "listener") == set()


def test_monitoring_only_from_monitoring_cidrs():
    assert sources(rules_of("worker-3"), "monitoring") == {"10.20.0.0/16"}


def test_no_admin_cidrs_is_refused_rather_than_locking_out_ssh():
    raw = stackfile.cluster_keys(stackfile.read("onprem"))
    raw["access"] = {**raw["access"], "adminCidrs": []}
    with pytest.raises((ValueError, config.ConfigError), match="adminCidrs"):
        firewall.host_rules(config.validate(raw), "master")
    with pytest.raises(ValueError, match="SSH"):
        firewall.apply_script([Rule("cluster-all", "10.0.0.1/32", "all", "all")], "ufw", node_ip="10.0.0.2")


@pytest.mark.parametrize("flavour", firewall.FLAVOURS)
@pytest.mark.parametrize("node", ["master", "worker-1"])
def test_scripts_are_shellcheck_clean(flavour, node, tmp_path):
    node_ip = str(next(n.ip for n in ONPREM.nodes if n.name == node))
    shellcheck(firewall.apply_script(rules_of(node), flavour, node_ip=node_ip), tmp_path)
    shellcheck(firewall.revert_script(flavour), tmp_path)


@pytest.mark.parametrize("flavour", firewall.FLAVOURS)
def test_disaggregated_scripts_are_shellcheck_clean(flavour, tmp_path):
    rules = firewall.host_rules(ONPREM_DISAGGREGATED, "worker-2")
    shellcheck(firewall.apply_script(rules, flavour, node_ip="192.168.1.102"), tmp_path)


# --- serving.mode disaggregated: NIXL's rows from the other pool only ----------------------------
# ONPREM_DISAGGREGATED: master (.100) and worker-1 (.101) prefill, worker-2 (.102) and worker-3 (.103)
# decode; NIXL's rows are kv-side-channel 5600 and kv-data 5601-5680 (ucx, bare metal's default).


def test_a_disaggregated_host_drops_its_own_pools_other_members_on_nixls_rows_only():
    rules = firewall.host_rules(ONPREM_DISAGGREGATED, "worker-2")
    denies = [(r.name, r.source, r.ports, r.protocol) for r in rules if r.action == "deny"]
    assert denies == [
        ("kv-side-channel", "192.168.1.103/32", "5600", "tcp"),
        ("kv-data", "192.168.1.103/32", "5601-5680", "tcp"),
    ]
    # Everything the member rule admits stays admitted, from both pools; SSH still comes first.
    assert sources(rules, "cluster-all") == {"192.168.1.100/31", "192.168.1.103/32"}
    assert rules[0].name == "ssh" and [r.action for r in rules[1:3]] == ["deny", "deny"]
    # The prefill side: worker-1 only, from master's.
    assert {(r.name, r.source) for r in firewall.host_rules(ONPREM_DISAGGREGATED, "master") if r.denies} == {
        ("kv-side-channel", "192.168.1.101/32"),
        ("kv-data", "192.168.1.101/32"),
    }


def test_aggregated_and_aws_stacks_drop_nothing(aws_raw):
    assert not any(rule.denies for node in ONPREM.nodes for rule in rules_of(node.name))
    assert validate(disaggregated(aws_raw)).fenced_pool("master") is None
    text = firewall.apply_script(rules_of("worker-1"), "ufw", node_ip="192.168.1.101")
    assert "prepend" not in text and "ufw deny" not in text


def test_nftables_drops_the_own_pool_on_nixls_rows_before_the_member_accept():
    rules = firewall.host_rules(ONPREM_DISAGGREGATED, "worker-2")
    text = firewall.apply_script(rules, "nftables", node_ip="192.168.1.102")
    side = text.index('ip saddr 192.168.1.103/32 tcp dport 5600 drop comment "kv-side-channel"')
    data = text.index('ip saddr 192.168.1.103/32 tcp dport 5601-5680 drop comment "kv-data"')
    member = text.index('ip saddr @cluster_nodes accept comment "cluster-all"')
    assert text.index("policy drop;") < side < data < member
    assert text.count(" drop comment ") == 2  # nothing else is dropped by name
    assert text.count("table inet qwen_cluster {") == 1  # still the one atomic table


def test_ufw_prepends_the_drops_so_they_precede_the_member_allow():
    rules = firewall.host_rules(ONPREM_DISAGGREGATED, "worker-2")
    text = firewall.apply_script(rules, "ufw", node_ip="192.168.1.102")
    # Written in the form `ufw show added` prints (the stale-rule pass compares it)...
    deny = "ufw deny from 192.168.1.103 to any port 5600 proto tcp comment 'qwen-cluster:kv-side-channel'"
    data = "ufw deny from 192.168.1.103 to any port 5601:5680 proto tcp comment 'qwen-cluster:kv-data'"
    assert deny in text and data in text
    # ... and added with `ufw prepend`, before the allows of the same run.
    assert '"ufw deny "*) rule="ufw prepend ${rule#ufw }"' in text
    assert text.index(deny) < text.index("ufw allow from 192.168.1.100/31 comment 'qwen-cluster:cluster-all'")


def test_firewalld_drops_the_own_pool_with_a_negative_priority():
    rules = firewall.host_rules(ONPREM_DISAGGREGATED, "worker-2")
    text = firewall.apply_script(rules, "firewalld", node_ip="192.168.1.102")
    assert (
        '<rule family="ipv4" priority="-1"><source address="192.168.1.103/32"/>'
        '<port port="5600" protocol="tcp"/><drop/></rule>'
    ) in text
    assert (
        'rule priority="-1" family="ipv4" source address="192.168.1.103/32" port port="5601-5680" '
        'protocol="tcp" drop'
    ) in text
    assert 'rule family="ipv4" source address="192.168.1.103/32" accept' in text  # the member rule stays
    assert text.count("priority=") == 4  # the drops only: two rows, in the zone file and as rich rules


def test_policy_document_carries_the_drops_which_open_nothing():
    rules = firewall.host_rules(ONPREM_DISAGGREGATED, "worker-2")
    document = firewall.policy_document(ONPREM_DISAGGREGATED, "worker-2", rules)
    assert [r["ports"] for r in document["rules"] if r["action"] == "deny"] == ["5600", "5601-5680"]
    (parsed,) = net.firewall_documents({"triggers": [document]})
    assert len(parsed.rules) == len(rules) - 2 and parsed.problems == ()
    assert firewall.ssh_sources(rules) == firewall.ssh_sources([r for r in rules if not r.denies])


def test_ufw_allows_ssh_before_default_deny_and_persists():
    text = firewall.apply_script(rules_of("worker-1"), "ufw", node_ip="192.168.1.101")
    ssh = text.index("ufw allow from 203.0.113.10 to any port 22 proto tcp comment 'qwen-cluster:ssh'")
    assert ssh < text.index("ufw default deny incoming")
    assert "ufw allow from 192.168.1.102/31 comment 'qwen-cluster:cluster-all'" in text
    assert "to any port 5000 proto tcp comment 'qwen-cluster:model-service'" in text
    assert "ufw --force enable" in text
    assert "192.168.1.0/24" not in text


def test_ufw_ranges_use_colon_syntax():
    rules = [Rule("ssh", "10.0.0.0/8", "22", "tcp"), Rule("r", "10.0.0.0/8", "6000-6100", "tcp")]
    assert "port 6000:6100 proto tcp" in firewall.apply_script(rules, "ufw", node_ip="10.0.0.1")


def test_nftables_is_one_atomic_table_with_a_member_set_and_default_drop():
    text = firewall.apply_script(rules_of("worker-1"), "nftables", node_ip="192.168.1.101")
    assert "policy drop;" in text
    assert "flags interval" in text
    assert "elements = { 192.168.1.100, 192.168.1.102/31 }" in text
    assert "ip saddr @cluster_nodes accept" in text
    assert 'iif "lo" accept' in text and "ct state established,related accept" in text
    assert "ip saddr 192.168.1.100/32 tcp dport 5000 accept" in text
    assert 'include \\"$rules_file\\"' in text  # persisted through the distribution's main file


def test_firewalld_zone_rejects_by_default_and_holds_rich_rules():
    text = firewall.apply_script(rules_of("master"), "firewalld", node_ip="192.168.1.100")
    assert '<zone target="default">' in text
    assert '<source address="203.0.113.10/32"/><port port="22" protocol="tcp"/><accept/>' in text
    assert '<rule family="ipv4"><source address="192.168.1.101/32"/><accept/></rule>' in text
    assert "firewall-cmd --reload" in text


def test_ipv6_client_cidrs_use_the_ipv6_family():
    rules = [Rule("ssh", "2001:db8::/32", "22", "tcp")]
    assert '<rule family="ipv6">' in firewall.apply_script(rules, "firewalld", node_ip="10.0.0.1")
    assert "ip6 saddr 2001:db8::/32 tcp dport 22" in firewall.apply_script(rules, "nftables", node_ip="x")


@needs_netns
@tools.needs("nft")
def test_nftables_script_loads_twice_and_filters_for_real(tmp_path):
    # a = 10.231.0.1 plays an outsider; b holds the firewall with a as its only admin.
    rules = [
        Rule("ssh", "10.231.0.1/32", "22", "tcp"),
        Rule("cluster-all", "10.231.0.9/32", "all", "all"),
        Rule("model-service", "10.231.0.9/32", "5000", "tcp"),
    ]
    etc, state = tmp_path / "etc", tmp_path / "state"
    text = firewall.apply_script(
        rules, "nftables", node_ip="10.231.0.2", etc=str(etc), state_dir=str(state), persist=False
    )
    with netns_pair() as (a, b):
        for _ in range(2):
            result = run_in(b, text, tmp_path)
            assert result.returncode == 0, result.stderr
        listing = subprocess.run(
            ["ip", "netns", "exec", b, "nft", "list", "ruleset"], capture_output=True, text=True
        )
        assert listing.stdout.count("table inet qwen_cluster") == 1

        def connect(port: int) -> str:
            probe = f"timeout 2 bash -c 'exec 3<>/dev/tcp/10.231.0.2/{port}' 2>&1 || true"
            return subprocess.run(
                ["ip", "netns", "exec", a, "bash", "-c", probe], capture_output=True, text=True
            ).stdout

        assert "refused" in connect(22)  # admitted; nothing listens
        assert "refused" not in connect(5000)  # dropped: a is not the load balancer
        revert = firewall.revert_script("nftables", etc=str(etc), state_dir=str(state), persist=False)
        assert run_in(b, revert, tmp_path).returncode == 0
        assert "refused" in connect(5000)


def test_ufw_rules_are_written_in_ufws_canonical_form_so_stale_ones_are_found():
    """The stale-rule sweep compares `ufw show added` lines with ours verbatim."""
    import builtins
    import re
    import sys

    sys.path.append("/usr/lib/python3/dist-packages")
    try:
        builtins._ = getattr(builtins, "_", lambda text: text)
        from ufw import common, parser, util
    except ImportError:
        pytest.skip("Debian's ufw is not installed")
    finally:
        sys.path.remove("/usr/lib/python3/dist-packages")
    hosts = ((ONPREM, "worker-1", "192.168.1.101"), (ONPREM_DISAGGREGATED, "worker-2", "192.168.1.102"))
    for cluster, node, ip in hosts:
        rules = firewall.host_rules(cluster, node)
        text = firewall.apply_script(rules, "ufw", node_ip=ip)
        ours = set(re.findall(r"^ufw (?:allow|deny) .*'$", text, re.MULTILINE))
        for rule in rules:
            port = "any" if rule.ports == "all" else rule.ports.replace("-", ":")
            protocol = "any" if rule.ports == "all" else "tcp"
            ufw_rule = common.UFWRule(rule.action, protocol, port, src=rule.source)
            ufw_rule.set_comment(util.hex_encode(f"qwen-cluster:{rule.name}"))
            ufw_rule.normalize()  # what ufw does when it stores a rule: 10.0.0.1/32 -> 10.0.0.1
            assert "ufw " + parser.UFWCommandRule.get_command(ufw_rule) in ours


# Loops inside the peer's namespace: new TCP connections to one port, one after another, until
# the stop file appears; each attempt appends "+" (connected) or "-" to the progress file, so
# the test can wait for attempts, and at the end it prints how many it tried and how many
# connected (0.5 s each at most: a SYN that meets a deny is dropped and retried only after a
# second). The 2 ms pause paces the attempts; it synchronises nothing: without it, thousands of
# connections a second would fill the port range with TIME_WAIT sockets during a long apply.
_PROBE_LOOP = """
import os, socket, sys, time
host, port, stop, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tried = connected = 0
with open(progress, "a", buffering=1) as log:
    while not os.path.exists(stop):
        tried += 1
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            connected += 1
            log.write("+")
        except OSError:
            log.write("-")
        log.flush()
        time.sleep(0.002)
print(tried, connected)
"""
_LISTENER = """
import socket, sys, threading
def serve(port):
    server = socket.create_server(("0.0.0.0", port), backlog=128)
    while True:
        server.accept()[0].close()
ports = [int(port) for port in sys.argv[1:]]
for port in ports[1:]:
    threading.Thread(target=serve, args=(port,), daemon=True).start()
serve(ports[0])
"""


@contextlib.contextmanager
def _firewalled_pair(*ports: int):
    """Two namespaces; the second has its own copy of /etc/ufw and /etc/default (which
    `ip netns exec` mounts over /etc) and TCP listeners on `ports`."""
    import shutil
    from pathlib import Path

    with netns_pair() as (a, b):
        etc = Path("/etc/netns") / b
        made_root = not Path("/etc/netns").exists()
        try:
            etc.mkdir(parents=True)
            if Path("/etc/ufw").exists():
                shutil.copytree("/etc/ufw", etc / "ufw", symlinks=True)
            shutil.copytree("/etc/default", etc / "default", symlinks=True)
            serve = ["ip", "netns", "exec", b, "python3", "-c", _LISTENER, *map(str, ports)]
            listener = subprocess.Popen(serve)
            try:
                yield a, b
            finally:
                listener.kill()
                listener.wait()
        finally:
            shutil.rmtree(etc, ignore_errors=True)
            if made_root:
                shutil.rmtree("/etc/netns", ignore_errors=True)


@pytest.fixture
def probed_pair():
    """`_firewalled_pair` with listeners on :7000 and :7001."""
    with _firewalled_pair(7000, 7001) as pair:
        yield pair


def _apply_in(ns: str, rules: list[Rule], flavour: str, tmp_path) -> str:
    """The apply script of `rules` run in `ns` as the lab runs it (its state under tmp_path, no
    persistence); its output."""
    env = {"QWEN_STATE_DIR": str(tmp_path / "state"), "QWEN_PERSIST": "no"}
    text = firewall.apply_script(rules, flavour, node_ip="10.231.0.2", etc=str(tmp_path / "etc"))
    path = tmp_path / "firewall.sh"
    path.write_text(text)
    result = subprocess.run(
        ["ip", "netns", "exec", ns, "env", *(f"{k}={v}" for k, v in env.items()), "bash", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _while_probing(a: str, tmp_path, action) -> dict[int, tuple[int, int]]:
    """(tried, connected) per port, probed from `a` all through `action`: the probes have
    begun (and :7000, open before, admitted one) before it starts, and each port has had an
    attempt begun after it ended before they stop."""
    stop = tmp_path / "stop-probing"
    stop.unlink(missing_ok=True)
    progress = {port: tmp_path / f"probes-{port}" for port in (7000, 7001)}
    for path in progress.values():
        path.write_text("")
    probe = ["ip", "netns", "exec", a, "python3", "-c", _PROBE_LOOP, "10.231.0.2"]
    probers = {
        port: subprocess.Popen(
            [*probe, str(port), str(stop), str(progress[port])], stdout=subprocess.PIPE, text=True
        )
        for port in (7000, 7001)
    }

    def attempts(port: int) -> str:
        return progress[port].read_text()

    try:
        wait_until(lambda: "+" in attempts(7000), what="a connection to :7000 before the change", timeout=10)
        wait_until(lambda: attempts(7001), what="an attempt on :7001 before the change", timeout=10)
        action()
        # Two more attempts on each port: the second of them began after the action had ended.
        ended = {port: len(attempts(port)) for port in progress}
        for port in progress:
            wait_until(
                lambda port=port: len(attempts(port)) >= ended[port] + 2,
                what=f"two attempts on :{port} after the change",
                timeout=10,
            )
    finally:
        stop.touch()
    counts = {}
    for port, prober in probers.items():
        out, _ = prober.communicate(timeout=30)
        tried, connected = map(int, out.split())
        counts[port] = (tried, connected)
    return counts


@needs_netns
@pytest.mark.parametrize("flavour", ["ufw", "nftables"])
def test_a_membership_change_neither_closes_a_kept_rule_nor_opens_anything_in_between(
    flavour, probed_pair, tmp_path
):
    """A node leaves and another joins. The peer 10.231.0.1, admitted to :7000 before and
    after, opens new connections all along the re-apply: none fails (a reset, or a revert
    before the apply, would drop them). Its connections to :7001, closed before and after,
    never get through."""

    tools.require("ufw" if flavour == "ufw" else "nft")
    a, b = probed_pair
    kept = [
        Rule("ssh", "203.0.113.10/32", "22", "tcp"),
        Rule("model-service", "10.231.0.1/32", "7000", "tcp"),
    ]
    leaving = [Rule("cluster-all", f"10.231.0.{n}/32", "all", "all") for n in (7, 9, 11)]
    joining = [Rule("cluster-all", "10.231.0.13/32", "all", "all")]

    def apply(rules):
        return _apply_in(b, rules, flavour, tmp_path)

    apply(kept + leaving)
    counts = _while_probing(a, tmp_path, lambda: apply(kept + joining))
    (kept_tried, kept_connected), (closed_tried, closed_connected) = counts[7000], counts[7001]
    assert kept_tried > 20 and kept_connected == kept_tried, counts
    assert closed_tried > 0 and closed_connected == 0, counts
    if flavour == "ufw":
        listing = subprocess.run(
            ["ip", "netns", "exec", b, "ufw", "show", "added"], capture_output=True, text=True
        )
        assert "10.231.0.13" in listing.stdout and "10.231.0.7" not in listing.stdout
        assert "removing stale rule" not in apply(kept + joining)  # nothing to change: nothing changes
    else:
        listing = subprocess.run(
            ["ip", "netns", "exec", b, "nft", "list", "ruleset"], capture_output=True, text=True
        )
        assert "10.231.0.13" in listing.stdout and "10.231.0.7" not in listing.stdout


def test_firewalld_changes_a_live_zone_in_place_new_rules_before_stale_ones():
    """firewalld's --reload flushes every zone and drops while it rebuilds: only the first run
    (a zone that is not live yet) may use it; later runs add, then remove."""
    text = firewall.apply_script(rules_of("worker-1"), "firewalld", node_ip="192.168.1.101")
    live = text[text.index("if firewall-cmd --get-zones") : text.index("else\n  # First run")]
    assert "--reload" not in live
    assert live.index("--add-rich-rule") < live.index("--remove-rich-rule")
    assert 'rule family="ipv4" source address="192.168.1.100/32" accept' in text  # a member, all traffic
    assert 'source address="192.168.1.100/32" port port="5000" protocol="tcp" accept' in text


def _pd_trio(prefill: list[str], decode: list[str]):
    """A disaggregated stack of three nodes on the namespace pair's segment: worker-1 (10.231.0.2)
    holds the firewall; master (10.231.0.3) and worker-2 (10.231.0.1) are both addresses of the
    peer namespace, which connects from either."""
    raw = disaggregated(copy.deepcopy(BASE_BARE_METAL))
    raw["nodes"] = [
        {"name": "master", "ip": "10.231.0.3", "role": "master"},
        {"name": "worker-1", "ip": "10.231.0.2"},
        {"name": "worker-2", "ip": "10.231.0.1"},
    ]
    raw["network"] = {**raw["network"], "cidr": "10.231.0.0/24"}
    raw["serving"] = {**raw["serving"], "prefill": {"nodes": prefill}, "decode": {"nodes": decode}}
    return validate(raw)


# One line per port: open, refused, or dropped (no answer within the timeout).
_CONNECT_FROM = """
import socket, sys
source, host, ports = sys.argv[1], sys.argv[2], sys.argv[3:]
for port in map(int, ports):
    try:
        socket.create_connection((host, port), timeout=0.5, source_address=(source, 0)).close()
        print("open")
    except ConnectionRefusedError:
        print("refused")
    except OSError:
        print("dropped")
"""


@needs_netns
@pytest.mark.parametrize("flavour", ["ufw", "nftables"])
def test_a_same_pool_members_syn_to_nixls_ports_is_dropped_while_the_other_pools_passes(flavour, tmp_path):
    """The rendered scripts of worker-1 in a real kernel, day 2. With master in the other (decode)
    pool, master reaches everything. Master moved into worker-1's (prefill) pool, whose member rule
    is live already: master's SYN to the side channel (5600) and UCX's range (5680) is dropped,
    worker-2's (decode) connects, and a port outside NIXL's rows (inter-node 6000) admits both; a
    rerun changes nothing. Master moved back: its drops go as stale, and it connects again."""
    tools.require("ufw" if flavour == "ufw" else "nft")
    ports = (5600, 5680, 6000)
    apart = firewall.host_rules(_pd_trio(["worker-1"], ["master", "worker-2"]), "worker-1")
    together = firewall.host_rules(_pd_trio(["master", "worker-1"], ["worker-2"]), "worker-1")
    assert not any(rule.denies for rule in apart)
    assert {(r.source, r.ports) for r in together if r.denies} == {
        ("10.231.0.3/32", "5600"),
        ("10.231.0.3/32", "5601-5680"),
    }
    with _firewalled_pair(*ports) as (a, b):
        links = ["ip", "-n", a, "-o", "link", "show", "type", "veth"]
        link = subprocess.run(links, capture_output=True, text=True).stdout  # "2: va1b2c3@if2: <...> ..."
        veth = link.split(":")[1].strip().split("@")[0]
        subprocess.run(["ip", "-n", a, "addr", "add", "10.231.0.3/24", "dev", veth], check=True)

        def reach(source: str) -> dict[int, str]:
            probe = ["ip", "netns", "exec", a, "python3", "-c", _CONNECT_FROM, source, "10.231.0.2"]
            done = subprocess.run([*probe, *map(str, ports)], capture_output=True, text=True, timeout=30)
            return dict(zip(ports, done.stdout.split(), strict=True))

        everything_open = dict.fromkeys(ports, "open")
        wait_until(lambda: reach("10.231.0.3") == everything_open, what="the listeners", timeout=10)
        _apply_in(b, apart, flavour, tmp_path)
        assert reach("10.231.0.3") == everything_open  # master's member rule is live

        _apply_in(b, together, flavour, tmp_path)
        assert reach("10.231.0.3") == {5600: "dropped", 5680: "dropped", 6000: "open"}  # the same pool
        assert reach("10.231.0.1") == everything_open  # the other pool
        assert "removing stale rule" not in _apply_in(b, together, flavour, tmp_path)
        if flavour == "ufw":
            show = ["ip", "netns", "exec", b, "ufw", "show", "added"]
            added = subprocess.run(show, capture_output=True, text=True).stdout
            assert added.count("ufw deny from 10.231.0.3") == 2, added  # none added twice

        moved = _apply_in(b, apart, flavour, tmp_path)
        if flavour == "ufw":
            assert moved.count("removing stale rule: ufw deny from 10.231.0.3") == 2, moved
        assert reach("10.231.0.3") == everything_open
