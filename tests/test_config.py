"""The stack config: every rule has a failing example whose message is asserted."""

from __future__ import annotations

import pytest

from qwen_cluster import config
from qwen_cluster.config import ConfigError, validate


def errors_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(raw)
    return caught.value.errors


def assert_one_error(raw: dict, expected: str) -> None:
    errors = errors_of(raw)
    assert errors == [expected], errors


# --- valid configs ---------------------------------------------------------------------------


def test_valid_aws_config_applies_defaults(aws_raw):
    cluster = validate(aws_raw)
    assert cluster.target is config.Target.AWS
    assert cluster.load_balancer.port == 80
    assert cluster.load_balancer.idle_timeout_seconds == 3600
    assert cluster.model.name == "Qwen/Qwen3-32B"
    assert cluster.tuning.sysctl == config.DEFAULT_SYSCTL
    assert [entry.name for entry in cluster.ports] == [
        "model-service",
        "inter-node",
        "monitoring",
        "prometheus",
        "alertmanager",
    ]
    assert cluster.master.name == "master"
    assert cluster.model_port == 5000
    assert cluster.bandwidth_gbps == 100


def test_valid_bare_metal_config_puts_nginx_on_the_master_by_default(bare_metal_raw):
    cluster = validate(bare_metal_raw)
    assert cluster.load_balancer_node.name == "master"
    assert cluster.bandwidth_gbps == 25
    assert cluster.gpus_per_node == 8


def test_role_defaults_to_worker(aws_raw):
    cluster = validate(aws_raw)
    assert [node.role for node in cluster.nodes] == ["master", "worker", "worker", "worker"]


def test_ports_accept_numbers_and_range_strings(aws_raw):
    aws_raw["ports"] = [
        {"name": "model", "port": "5000", "scope": "clients"},
        {"name": "mesh", "port": "7000-7100", "scope": "cluster"},
        {"name": "ops", "port": 9200, "scope": "admin", "required": False},
    ]
    cluster = validate(aws_raw)
    assert [str(entry.port) for entry in cluster.ports] == [
        "5000",
        "7000-7100",
        "9200",
        "8000",
        "9090",
        "9093",
    ]


def test_ipv6_client_cidr_is_accepted(aws_raw):
    aws_raw["access"]["clientCidrs"] = ["10.0.0.0/8", "2001:db8::/32"]
    assert len(validate(aws_raw).access.client_cidrs) == 2


def test_internet_facing_clients_may_be_the_world(aws_raw):
    aws_raw["access"]["clientCidrs"] = ["0.0.0.0/0"]
    aws_raw["loadBalancer"] = {"scheme": "internet-facing"}
    assert validate(aws_raw).load_balancer.scheme == "internet-facing"


def test_string_numbers_from_pulumi_config_set_are_coerced(aws_raw):
    aws_raw["network"]["minBandwidthGbps"] = "25"
    assert validate(aws_raw).network.min_bandwidth_gbps == 25


# --- unknown and missing keys ------------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_near_one(aws_raw):
    aws_raw["netwrok"] = {}
    assert_one_error(aws_raw, "qwen-cluster:netwrok is not a known key (did you mean network?)")


def test_unknown_nested_key_is_named_with_its_path(aws_raw):
    aws_raw["nodes"][1]["nmae"] = "typo"
    assert_one_error(aws_raw, "nodes[1].nmae is not a known key")


def test_missing_required_sections_are_named(aws_raw):
    del aws_raw["network"], aws_raw["access"]
    errors = errors_of(aws_raw)
    assert "network is required" in errors
    assert "access is required" in errors


def test_missing_nested_key_is_named(aws_raw):
    del aws_raw["aws"]["instanceType"]
    assert_one_error(aws_raw, "aws.instanceType is required")


# --- nodes --------------------------------------------------------------------------------------


def test_at_least_two_nodes(aws_raw):
    aws_raw["nodes"] = aws_raw["nodes"][:1]
    assert_one_error(aws_raw, "nodes has 1 entries; the cluster needs at least 2 (4 or more recommended)")


def test_node_name_must_be_a_dns_label(aws_raw):
    aws_raw["nodes"][2]["name"] = "Worker_2"
    errors = errors_of(aws_raw)
    assert len(errors) == 1 and errors[0].startswith("nodes[2].name 'Worker_2': String should match")


def test_node_names_are_unique(aws_raw):
    aws_raw["nodes"][3]["name"] = "worker-1"
    assert_one_error(aws_raw, "nodes[3].name worker-1 is used already by nodes[1]")


def test_node_ips_are_unique(aws_raw):
    aws_raw["nodes"][2]["ip"] = "192.168.1.101"
    assert_one_error(aws_raw, "nodes[2].ip 192.168.1.101 is used already by nodes[1]")


def test_node_ip_must_be_an_address(aws_raw):
    aws_raw["nodes"][1]["ip"] = "192.168.1.300"
    assert_one_error(aws_raw, "nodes[1].ip '192.168.1.300' is not an IPv4 address")


def test_exactly_one_master_none(aws_raw):
    aws_raw["nodes"][0]["role"] = "worker"
    assert_one_error(aws_raw, "nodes has 0 masters []; exactly one node needs role: master")


def test_exactly_one_master_two(aws_raw):
    aws_raw["nodes"][3]["role"] = "master"
    assert_one_error(
        aws_raw, "nodes has 2 masters ['nodes[0]', 'nodes[3]']; exactly one node needs role: master"
    )


def test_role_is_master_or_worker(aws_raw):
    aws_raw["nodes"][1]["role"] = "leader"
    errors = errors_of(aws_raw)
    assert errors == ["nodes[1].role 'leader': Input should be 'master' or 'worker'"]


def test_node_ip_inside_the_cidr(aws_raw):
    aws_raw["nodes"][2]["ip"] = "192.168.2.5"
    assert_one_error(aws_raw, "nodes[2].ip 192.168.2.5 is outside network.cidr 192.168.1.0/24")


def test_node_ip_not_the_network_address(bare_metal_raw):
    bare_metal_raw["nodes"][1]["ip"] = "192.168.1.0"
    assert_one_error(
        bare_metal_raw, "nodes[1].ip 192.168.1.0 is the network address of network.cidr 192.168.1.0/24"
    )


def test_node_ip_not_the_broadcast_address(bare_metal_raw):
    bare_metal_raw["nodes"][1]["ip"] = "192.168.1.255"
    assert_one_error(
        bare_metal_raw, "nodes[1].ip 192.168.1.255 is the broadcast address of network.cidr 192.168.1.0/24"
    )


def test_aws_reserves_the_first_four_addresses(aws_raw):
    aws_raw["nodes"][1]["ip"] = "192.168.1.3"
    assert_one_error(
        aws_raw,
        "nodes[1].ip 192.168.1.3 is one of the first four addresses of 192.168.1.0/24, which AWS reserves",
    )


def test_bare_metal_may_use_low_addresses(bare_metal_raw):
    bare_metal_raw["nodes"][1]["ip"] = "192.168.1.3"
    assert validate(bare_metal_raw).nodes[1].ip.compressed == "192.168.1.3"


# --- network ------------------------------------------------------------------------------------


def test_cidr_with_host_bits_suggests_the_network(aws_raw):
    aws_raw["network"]["cidr"] = "192.168.1.7/24"
    errors = errors_of(aws_raw)
    assert errors == ["network.cidr '192.168.1.7/24' has host bits set (did you mean 192.168.1.0/24?)"]


def test_cidr_must_be_a_network(aws_raw):
    aws_raw["network"]["cidr"] = "not-a-cidr"
    assert errors_of(aws_raw) == ["network.cidr 'not-a-cidr' is not an IPv4 network in CIDR notation"]


def test_min_bandwidth_floor_is_ten(aws_raw):
    aws_raw["network"]["minBandwidthGbps"] = 5
    assert errors_of(aws_raw) == ["network.minBandwidthGbps 5: Input should be greater than or equal to 10"]


def test_max_latency_is_positive(aws_raw):
    aws_raw["network"]["maxLatencyMs"] = 0
    assert errors_of(aws_raw) == ["network.maxLatencyMs 0: Input should be greater than 0"]


def test_aws_subnet_size_limits(aws_raw):
    aws_raw["network"]["cidr"] = "192.168.0.0/15"
    aws_raw["nodes"] = [
        {"name": "master", "ip": "192.168.1.100", "role": "master"},
        {"name": "worker-1", "ip": "192.168.1.101"},
    ]
    assert_one_error(aws_raw, "network.cidr 192.168.0.0/15 is a /15; an AWS subnet is /16 to /28")


# --- ports --------------------------------------------------------------------------------------


def ports(*entries):
    return [dict(zip(("name", "port", "scope"), entry, strict=True)) for entry in entries]


def test_port_out_of_range(aws_raw):
    aws_raw["ports"] = ports(("model", 70000, "clients"), ("mesh", "6000-6100", "cluster"))
    assert errors_of(aws_raw) == ["ports[0].port 70000: port 70000 is outside 1-65535"]


def test_port_range_low_above_high(aws_raw):
    aws_raw["ports"] = ports(("model", 5000, "clients"), ("mesh", "6100-6000", "cluster"))
    assert errors_of(aws_raw) == ["ports[1].port '6100-6000': range low 6100 is above high 6000"]


def test_port_range_spelling(aws_raw):
    aws_raw["ports"] = ports(("model", 5000, "clients"), ("mesh", "6000:6100", "cluster"))
    assert errors_of(aws_raw) == ["ports[1].port '6000:6100' is not a port or a 'low-high' range"]


def test_port_names_are_unique(aws_raw):
    aws_raw["ports"] = ports(("model", 5000, "clients"), ("model", "6000-6100", "cluster"))
    assert_one_error(aws_raw, "ports[1].name 'model' is used already by ports[0]")


def test_port_entries_do_not_overlap(aws_raw):
    aws_raw["ports"] = ports(
        ("model", 5000, "clients"), ("mesh", "6000-6100", "cluster"), ("metrics", "6050", "monitoring")
    )
    assert_one_error(aws_raw, "ports[2].port 6050 (metrics) overlaps ports[1].port 6000-6100 (mesh)")


def test_scope_is_one_of_four(aws_raw):
    aws_raw["ports"] = ports(("model", 5000, "clients"), ("mesh", "6000-6100", "everyone"))
    errors = errors_of(aws_raw)
    assert errors == [
        "ports[1].scope 'everyone': Input should be 'clients', 'cluster', 'monitoring' or 'admin'"
    ]


def test_a_clients_entry_must_exist(aws_raw):
    aws_raw["ports"] = ports(("mesh", "6000-6100", "cluster"))
    assert_one_error(aws_raw, "ports has no entry with scope 'clients' (the model service)")


def test_a_cluster_entry_must_exist(aws_raw):
    aws_raw["ports"] = ports(("model", 5000, "clients"))
    assert_one_error(aws_raw, "ports has no entry with scope 'cluster' (communication between nodes)")


def test_cluster_range_too_small_to_pin_ray_and_vllm(aws_raw):
    aws_raw["ports"] = ports(("model", 5000, "clients"), ("mesh", "6000-6010", "cluster"))
    assert_one_error(
        aws_raw,
        "ports entry mesh (6000-6010) holds 11 ports; pinning Ray and vLLM needs at least 27 "
        "(10 Ray ports, 1 for vLLM, 16 Ray worker ports)",
    )


def test_ssh_port_is_not_a_table_entry(aws_raw):
    aws_raw["ports"] = ports(
        ("model", 5000, "clients"), ("mesh", "6000-6100", "cluster"), ("ssh", 22, "admin")
    )
    assert_one_error(
        aws_raw, "ports[2].port 22 (ssh) includes SSH port 22, which is governed by access.adminCidrs"
    )


# --- access -------------------------------------------------------------------------------------


def test_cidrs_must_be_valid(aws_raw):
    aws_raw["access"]["clientCidrs"] = ["10.0.0.0/8", "10.0.0.1"]
    assert errors_of(aws_raw) == [
        "access.clientCidrs[1] '10.0.0.1' is not a CIDR block (write e.g. 10.0.0.0/8 or 203.0.113.10/32)"
    ]


@pytest.mark.parametrize("world", ["0.0.0.0/0", "::/0"])
@pytest.mark.parametrize("key", ["adminCidrs", "monitoringCidrs"])
def test_admin_and_monitoring_never_the_world(aws_raw, key, world):
    aws_raw["access"][key] = ["10.1.0.0/16", world]
    assert_one_error(
        aws_raw, f"access.{key}[1] {world} opens to the whole internet; name the networks that need it"
    )


@pytest.mark.parametrize(
    ("split", "family"),
    [
        (["0.0.0.0/1", "128.0.0.0/1"], "IPv4"),
        (["2000::/4", "3000::/4"], "IPv6"),
        (["0.0.0.0/1", "128.0.0.0/2", "192.0.0.0/3"], "IPv4"),  # all but multicast and reserved
    ],
)
@pytest.mark.parametrize("key", ["adminCidrs", "monitoringCidrs"])
def test_admin_and_monitoring_never_the_world_however_split(aws_raw, key, split, family):
    aws_raw["access"][key] = ["10.1.0.0/16", *split]
    listed = ["10.1.0.0/16", *split] if family == "IPv4" else split  # the key's blocks of that family
    assert_one_error(
        aws_raw,
        f"access.{key} [{', '.join(listed)}] together cover every public {family} address: "
        "that opens to the whole internet; name the networks that need it",
    )


@pytest.mark.parametrize("block", ["::/1", "2000::/3"])  # each holds every global unicast address
def test_one_ipv6_block_holding_every_global_address_is_the_world_by_itself(aws_raw, block):
    aws_raw["access"]["adminCidrs"] = [block, "8000::/1"]
    assert_one_error(
        aws_raw, f"access.adminCidrs[0] {block} opens to the whole internet; name the networks that need it"
    )


def test_private_and_documentation_space_together_is_not_the_world(aws_raw):
    aws_raw["access"]["adminCidrs"] = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "203.0.113.0/24"]
    assert validate(aws_raw).access.admin_cidrs


def test_internet_facing_clients_may_be_the_world_split_in_halves(aws_raw):
    aws_raw["access"]["clientCidrs"] = ["0.0.0.0/1", "128.0.0.0/1"]
    aws_raw["loadBalancer"] = {"scheme": "internet-facing"}
    assert len(validate(aws_raw).access.client_cidrs) == 2


def test_client_cidrs_are_required(aws_raw):
    aws_raw["access"]["clientCidrs"] = []
    errors = errors_of(aws_raw)
    assert len(errors) == 1 and errors[0].startswith(
        "access.clientCidrs []: List should have at least 1 item"
    )


# --- model --------------------------------------------------------------------------------------


def test_node_count_divisible_by_pipeline_parallel(aws_raw):
    aws_raw["model"] = {"tensorParallel": 4, "pipelineParallel": 3}
    assert_one_error(aws_raw, "model.pipelineParallel 3 does not divide the 4 nodes into whole replicas")


def test_tensor_parallel_within_the_catalog_gpus(aws_raw):
    aws_raw["model"] = {"tensorParallel": 8}
    assert_one_error(
        aws_raw, "model.tensorParallel 8 is more than the 4 GPUs per node of aws.instanceType g6e.12xlarge"
    )


def test_tensor_parallel_within_bare_metal_gpus(bare_metal_raw):
    bare_metal_raw["bareMetal"]["gpusPerNode"] = 2
    bare_metal_raw["bareMetal"]["gpuMemoryGb"] = 80
    bare_metal_raw["model"] = {"tensorParallel": 4}
    assert_one_error(bare_metal_raw, "model.tensorParallel 4 is more than the 2 GPUs per node of bareMetal")


def test_tensor_parallel_divides_the_attention_heads(bare_metal_raw):
    bare_metal_raw["model"] = {"tensorParallel": 3}
    assert_one_error(
        bare_metal_raw, "model.tensorParallel 3 does not divide Qwen/Qwen3-32B's 64 attention heads"
    )


def test_replica_memory_must_hold_the_weights_with_headroom(bare_metal_raw):
    bare_metal_raw["model"] = {"tensorParallel": 1}
    assert_one_error(
        bare_metal_raw,
        "model.tensorParallel 1 x pipelineParallel 1 x 80 GB (bareMetal) = 80 GB per replica; Qwen/Qwen3-32B "
        "needs 91.1 GB (65.6 GB of weights at most 80% of 90% of GPU memory, the rest for the KV cache)",
    )


def test_pipeline_parallel_adds_memory_across_nodes(bare_metal_raw):
    bare_metal_raw["model"] = {"tensorParallel": 1, "pipelineParallel": 2}
    cluster = validate(bare_metal_raw)
    assert len(cluster.topology.replicas) == 2


def test_unknown_model_is_refused_with_the_known_ones(aws_raw):
    aws_raw["model"] = {"name": "Qwen/Qwen3-235B"}
    assert_one_error(
        aws_raw,
        "model.name Qwen/Qwen3-235B is not in the catalog (known: Qwen/Qwen3-32B, Qwen/Qwen3-32B-FP8)",
    )


@pytest.mark.parametrize("image", ["vllm/vllm-openai", "vllm/vllm-openai:latest"])
def test_model_image_must_be_pinned(aws_raw, image):
    aws_raw["model"] = {"image": image}
    assert errors_of(aws_raw) == [
        f"model.image {image!r} is not pinned: give a version tag or an @sha256 digest"
    ]


def test_model_image_digest_counts_as_pinned(aws_raw):
    aws_raw["model"] = {"image": "registry.local:5000/vllm@sha256:" + "a" * 64}
    assert validate(aws_raw).model.image.endswith("a" * 64)


# --- targets ------------------------------------------------------------------------------------


def test_target_section_is_required(aws_raw):
    del aws_raw["aws"]
    assert_one_error(aws_raw, "aws is required when target is aws")


def test_other_target_section_is_refused(aws_raw, bare_metal_raw):
    aws_raw["bareMetal"] = bare_metal_raw["bareMetal"]
    assert_one_error(aws_raw, "bareMetal is refused when target is aws (remove the section)")


def test_bare_metal_refuses_the_aws_section(aws_raw, bare_metal_raw):
    bare_metal_raw["aws"] = aws_raw["aws"]
    assert_one_error(bare_metal_raw, "aws is refused when target is bare-metal (remove the section)")


def test_target_is_aws_or_bare_metal(aws_raw):
    aws_raw["target"] = "gcp"
    errors = errors_of(aws_raw)
    assert errors[0] == "target 'gcp': Input should be 'aws' or 'bare-metal'"


def test_instance_type_must_be_in_the_catalog(aws_raw):
    aws_raw["aws"]["instanceType"] = "x9.huge"
    errors = errors_of(aws_raw)
    assert len(errors) == 1 and errors[0].startswith("aws.instanceType x9.huge is not in the catalog")


@pytest.mark.parametrize(
    ("kind", "figures"),
    [
        ("g5.xlarge", "2.5 Gbit/s (Up to 10 Gigabit)"),
        ("g4dn.xlarge", "5 Gbit/s (Up to 25 Gigabit)"),
        ("g6.xlarge", "2.5 Gbit/s (Up to 10 Gigabit)"),
    ],
)
def test_low_bandwidth_types_are_refused_by_name_with_their_figures(aws_raw, kind, figures):
    aws_raw["aws"] = {**aws_raw["aws"], "instanceType": kind, "efa": False}
    aws_raw["model"] = {"tensorParallel": 1, "name": "Qwen/Qwen3-32B-FP8"}
    errors = errors_of(aws_raw)
    assert f"aws.instanceType {kind} has a baseline of {figures}, below network.minBandwidthGbps 10" in errors


def test_t3_large_has_no_gpu_and_too_little_bandwidth(aws_raw):
    aws_raw["aws"]["instanceType"] = "t3.large"
    aws_raw["aws"]["efa"] = False
    errors = errors_of(aws_raw)
    assert "aws.instanceType t3.large has no GPU" in errors
    assert (
        "aws.instanceType t3.large has a baseline of 0.512 Gbit/s (Up to 5 Gigabit), "
        "below network.minBandwidthGbps 10" in errors
    )


def test_efa_on_a_type_without_efa_names_the_type(aws_raw):
    aws_raw["aws"]["instanceType"] = "g4dn.xlarge"
    aws_raw["network"]["minBandwidthGbps"] = 10
    errors = errors_of(aws_raw)
    assert "aws.efa is true but aws.instanceType g4dn.xlarge has no EFA support" in errors


def test_instance_bandwidth_below_the_configured_floor(aws_raw):
    aws_raw["network"]["minBandwidthGbps"] = 200
    assert_one_error(
        aws_raw,
        "aws.instanceType g6e.12xlarge has a baseline of 100 Gbit/s (100 Gigabit), "
        "below network.minBandwidthGbps 200",
    )


def test_bastion_needs_admin_cidrs(aws_raw):
    aws_raw["aws"]["bastion"] = True
    aws_raw["access"]["adminCidrs"] = []
    assert_one_error(aws_raw, "aws.bastion is true but access.adminCidrs is empty: nobody could reach it")


def test_aws_ids_have_their_shape(aws_raw):
    aws_raw["aws"]["vpcId"] = "vpc-xyz"
    errors = errors_of(aws_raw)
    assert len(errors) == 1 and errors[0].startswith("aws.vpcId 'vpc-xyz': String should match pattern")


def test_nic_speed_below_the_floor(bare_metal_raw):
    bare_metal_raw["network"]["minBandwidthGbps"] = 40
    assert_one_error(bare_metal_raw, "bareMetal.nicSpeedGbps 25 is below network.minBandwidthGbps 40")


def test_load_balancer_node_must_be_a_node(bare_metal_raw):
    bare_metal_raw["bareMetal"]["loadBalancerNode"] = "gateway"
    assert_one_error(bare_metal_raw, "bareMetal.loadBalancerNode gateway is not one of the nodes")


def test_firewall_flavour(bare_metal_raw):
    bare_metal_raw["bareMetal"]["firewall"] = "iptables"
    assert errors_of(bare_metal_raw) == [
        "bareMetal.firewall 'iptables': Input should be 'ufw', 'firewalld' or 'nftables'"
    ]


# --- load balancer ------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [30, 7200])
def test_nlb_idle_timeout_range(aws_raw, seconds):
    aws_raw["loadBalancer"] = {"idleTimeoutSeconds": seconds}
    assert_one_error(
        aws_raw, f"loadBalancer.idleTimeoutSeconds {seconds} is outside 60-6000, what target aws allows"
    )


NLB_LOW, NLB_HIGH = config.NLB_IDLE_TIMEOUT_SECONDS


@pytest.mark.parametrize(
    ("seconds", "inside"),
    [(NLB_LOW - 1, False), (NLB_LOW, True), (NLB_HIGH, True), (NLB_HIGH + 1, False)],
)
def test_the_nlb_component_refuses_exactly_what_the_config_refuses(aws_raw, seconds, inside):
    from components.aws.loadbalancer import ModelLoadBalancerArgs

    aws_raw["loadBalancer"] = {"idleTimeoutSeconds": seconds}
    args = ModelLoadBalancerArgs(
        vpc_id="vpc-1",
        subnet_ids=["subnet-1"],
        security_group_id="sg-1",
        internal=True,
        listener_port=80,
        model_port=5000,
        idle_timeout_seconds=seconds,
        deregistration_delay_seconds=300,
        tags={},
    )
    if inside:
        validate(aws_raw)
        args.validate()
    else:
        assert_one_error(
            aws_raw,
            f"loadBalancer.idleTimeoutSeconds {seconds} is outside {NLB_LOW}-{NLB_HIGH}, "
            "what target aws allows",
        )
        with pytest.raises(
            ValueError, match=f"NLB TCP idle timeout {seconds} is outside {NLB_LOW}-{NLB_HIGH}"
        ):
            args.validate()


def test_bare_metal_idle_timeout_may_exceed_the_nlb_limit(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"idleTimeoutSeconds": 7200}
    assert validate(bare_metal_raw).load_balancer.idle_timeout_seconds == 7200


def test_bare_metal_listener_must_not_collide_with_the_port_table(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"port": 5000}
    assert_one_error(
        bare_metal_raw,
        "loadBalancer.port 5000 collides with ports[0] model-service 5000 on the load-balancer node",
    )


def test_internet_facing_is_for_aws_only(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"scheme": "internet-facing"}
    errors = errors_of(bare_metal_raw)
    assert errors == [
        "loadBalancer.scheme internet-facing applies to target aws only; on bare metal clients "
        "reach nginx through access.clientCidrs"
    ]


# --- tuning -------------------------------------------------------------------------------------


def test_sysctl_keys_are_dotted_names(aws_raw):
    aws_raw["tuning"] = {"sysctl": {"rmem_max": 1}}
    assert errors_of(aws_raw) == [
        "tuning.sysctl 'rmem_max' not a sysctl key (dotted, e.g. net.core.rmem_max)"
    ]


def test_sysctl_values_cannot_smuggle_shell(aws_raw):
    aws_raw["tuning"] = {"sysctl": {"net.core.rmem_max": "1; reboot"}}
    assert errors_of(aws_raw) == [
        "tuning.sysctl net.core.rmem_max='1; reboot': values are numbers or plain words"
    ]


# --- all at once --------------------------------------------------------------------------------


def test_several_mistakes_are_reported_together(aws_raw):
    aws_raw["nodes"][2]["ip"] = "192.168.2.5"  # outside the cidr
    aws_raw["nodes"][3]["nmae"] = "x"  # typo in a node
    aws_raw["access"]["adminCidrs"] = ["0.0.0.0/0"]  # world
    aws_raw["loadBalancer"] = {"idleTimeoutSeconds": 10}  # below the NLB floor
    aws_raw["model"] = {"tensorParallel": 16}  # more than 4 GPUs
    aws_raw["tuning"] = {"rdma": "maybe"}  # not a bool
    aws_raw["extra"] = 1  # unknown key
    errors = errors_of(aws_raw)
    assert set(errors) == {
        "qwen-cluster:extra is not a known key",
        "nodes[3].nmae is not a known key",
        "access.adminCidrs[0] 0.0.0.0/0 opens to the whole internet; name the networks that need it",
        "loadBalancer.idleTimeoutSeconds 10 is outside 60-6000, what target aws allows",
        "model.tensorParallel 16 is more than the 4 GPUs per node of aws.instanceType g6e.12xlarge",
        "tuning.rdma 'maybe': Input should be a valid boolean, unable to interpret input",
    }
    # nodes failed their own validation, so the IP rule waits for the typo to be fixed; the
    # message still lists every other problem in one go.


def test_config_error_message_lists_every_problem(aws_raw):
    aws_raw["nodes"][2]["ip"] = "192.168.2.5"
    aws_raw["access"]["monitoringCidrs"] = ["::/0"]
    with pytest.raises(ConfigError) as caught:
        validate(aws_raw)
    message = str(caught.value)
    assert message.startswith("invalid stack config (2 problems):")
    assert "nodes[2].ip 192.168.2.5 is outside network.cidr 192.168.1.0/24" in message
    assert "access.monitoringCidrs[0] ::/0 opens to the whole internet" in message


def test_cluster_config_constructed_directly_is_validated_too(aws_raw):
    aws_raw["nodes"][2]["ip"] = "192.168.2.5"
    with pytest.raises(ValueError, match="nodes\\[2\\].ip 192.168.2.5 is outside network.cidr"):
        config.ClusterConfig.model_validate(aws_raw)


def test_availability_zone_must_be_in_the_providers_region(aws_raw):
    with pytest.raises(ConfigError) as caught:
        validate(aws_raw, aws_region="us-east-1")
    assert caught.value.errors == ["aws.availabilityZone us-west-2a is not in aws:region us-east-1"]
    assert validate(aws_raw, aws_region="us-west-2").aws.region == "us-west-2"


def test_region_mismatch_stops_the_program_under_mocks():
    from tooling import offline, stackfile

    stack_config = stackfile.read("dev")
    stack_config["aws:region"] = "eu-west-1"
    render = offline.render(stack_config, "dev")
    assert render.resources == []
    assert "aws.availabilityZone us-west-2a is not in aws:region eu-west-1" in render.error
