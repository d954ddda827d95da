"""What the cluster may run on: EC2 instance types and model weights, with their figures.

Figures are AWS's published specifications:
  https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html  (accelerated computing:
      GPUs, GPU memory, network bandwidth, network cards, EFA)
  https://docs.aws.amazon.com/ec2/latest/instancetypes/gp.html  (general purpose: t3)
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html
"Up to N Gigabit" types burst above their baseline for minutes at most; a cluster that
moves activations between nodes all the time gets the baseline, so that is what counts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    gpu_model: str
    gpu_memory_gib: float  # per GPU, as AWS lists it (usable GiB, not the marketing GB)
    bandwidth: str  # as AWS states it
    baseline_gbps: float  # what we count
    network_cards: int
    max_efa_interfaces: int  # 0: no EFA support
    max_network_interfaces: int
    # AWS documents the `efa-only` interface type for these (efa-acc-inst-types.html);
    # elsewhere every extra card gets a full `efa` interface.
    efa_only_interfaces: bool = False

    @property
    def gpu_memory_gb(self) -> float:
        return round(self.gpu_memory_gib * GIB_IN_GB, 1)

    @property
    def efa(self) -> bool:
        return self.max_efa_interfaces > 0

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]


def _t(*args) -> InstanceType:
    return InstanceType(*args)


# name, GPUs, GPU, GiB per GPU, bandwidth as stated, baseline Gbit/s, network cards,
# max EFA interfaces (from DescribeInstanceTypes), max network interfaces, efa-only.
INSTANCE_TYPES: dict[str, InstanceType] = {
    t.name: t
    for t in (
        # EFA-capable GPU types: the ones a cluster can use.
        _t("g5.12xlarge", 4, "A10G", 22, "40 Gigabit", 40, 1, 1, 15),
        _t("g5.24xlarge", 4, "A10G", 22, "50 Gigabit", 50, 1, 1, 15),
        _t("g5.48xlarge", 8, "A10G", 22, "100 Gigabit", 100, 1, 1, 7),
        _t("g6e.12xlarge", 4, "L40S", 44, "100 Gigabit", 100, 1, 1, 10),
        _t("g6e.24xlarge", 4, "L40S", 44, "200 Gigabit", 200, 2, 2, 20),
        _t("g6e.48xlarge", 8, "L40S", 44, "400 Gigabit", 400, 4, 4, 40),
        _t("p4d.24xlarge", 8, "A100", 40, "4x 100 Gigabit", 400, 4, 4, 60),
        _t("p4de.24xlarge", 8, "A100", 80, "4x 100 Gigabit", 400, 4, 4, 60),
        _t("p5.48xlarge", 8, "H100", 80, "3200 Gigabit", 3200, 32, 32, 64, True),
        _t("p5e.48xlarge", 8, "H200", 141, "3200 Gigabit", 3200, 32, 32, 64, True),
        _t("p5en.48xlarge", 8, "H200", 141, "3200 Gigabit", 3200, 16, 16, 64, True),
        _t("p6-b200.48xlarge", 8, "B200", 179, "3200 Gigabit", 3200, 8, 8, 32, True),
        # Common low-bandwidth types, listed so they are refused by name with real figures.
        _t("g5.xlarge", 1, "A10G", 22, "Up to 10 Gigabit", 2.5, 1, 0, 4),
        _t("g4dn.xlarge", 1, "T4", 16, "Up to 25 Gigabit", 5, 1, 0, 3),
        _t("g6.xlarge", 1, "L4", 22, "Up to 10 Gigabit", 2.5, 1, 0, 4),
        _t("t3.large", 0, "-", 0, "Up to 5 Gigabit", 0.512, 1, 0, 3),
    )
}

GPU_FAMILIES = ("g", "p")
GIB_IN_GB = 1.073741824


def instance_type(name: str) -> InstanceType | None:
    return INSTANCE_TYPES.get(name)


def is_gpu_family(name: str) -> bool:
    """g* and p* families are GPU instances whatever the catalog knows of them."""
    return bool(name) and name[0] in GPU_FAMILIES and "." in name


@dataclass(frozen=True)
class ModelWeights:
    name: str
    parameters_billion: float
    bytes_per_parameter: float
    attention_heads: int  # tensor parallelism must divide them (vLLM refuses otherwise)
    # The KV cache's geometry (the model's config.json: num_hidden_layers, num_key_value_heads,
    # head_dim): what one token's K and V weigh, the bytes disaggregation moves per prompt token.
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weights_gb(self) -> float:
        return round(self.parameters_billion * self.bytes_per_parameter, 1)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token: 2 x layers x KV heads x head size x dtype bytes
        (Qwen3-32B in BF16: 2 x 64 x 8 x 128 x 2 = 262,144 B = 256 KiB)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @property
    def prefill_flops_per_token(self) -> float:
        """A dense transformer's forward pass: ~2 FLOPs per parameter per token. The attention
        over the context adds ~4 x layers x context x (heads x head_dim) per token (~7 % at a
        4k-token prompt for Qwen3-32B) and is left out: a lower cost per token means a higher
        prefill rate, so the link floor derived from it errs on the safe side."""
        return 2 * self.parameters_billion * 1e9


# Qwen3-32B: 32.8 B parameters, 64 query / 8 KV attention heads of size 128, 64 layers
# (model card and config.json, huggingface.co/Qwen/Qwen3-32B: num_hidden_layers 64,
# num_attention_heads 64, num_key_value_heads 8, head_dim 128). The FP8 checkpoint quantizes the
# linear layers only; its KV cache stays BF16 unless vLLM is given `--kv-cache-dtype fp8`.
MODELS: dict[str, ModelWeights] = {
    m.name: m
    for m in (
        ModelWeights("Qwen/Qwen3-32B", 32.8, 2.0, 64, 64, 8, 128),  # bf16: 65.6 GB
        ModelWeights("Qwen/Qwen3-32B-FP8", 32.8, 1.0, 64, 64, 8, 128),  # fp8 linear layers: ~32.8 GB
    )
}


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_dense_tflops: float  # the datasheet's dense BF16 tensor figure (not the "with sparsity" one)
    source: str


# Dense BF16 tensor throughput, from NVIDIA's datasheets (the figure without structured sparsity,
# which vLLM does not use). The prefill rate the link floor is derived from starts here
# (qwen_cluster/kvlink.py).
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("H100", 989.0, "NVIDIA H100 datasheet, H100 SXM: BF16 1,979 TFLOPS with sparsity"),
        Gpu("H200", 989.0, "NVIDIA H200 datasheet, H200 SXM: BF16 1,979 TFLOPS with sparsity"),
        Gpu("B200", 2250.0, "NVIDIA HGX B200 datasheet: BF16 36 PFLOPS with sparsity for 8 GPUs"),
        Gpu("A100", 312.0, "NVIDIA A100 datasheet: BF16 312 TFLOPS (624 with sparsity)"),
        Gpu("L40S", 362.05, "NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 with sparsity)"),
        # AWS publishes no tensor figure for its A10G; NVIDIA's A10 is the part it derives from.
        Gpu("A10G", 125.0, "NVIDIA A10 datasheet: BF16 125 TFLOPS (250 with sparsity)"),
    )
}


def gpu(name: str) -> Gpu | None:
    return GPUS.get(name)


# The memory rule. vLLM takes gpu_memory_utilization (0.9 by default) of every GPU; of that,
# the weights may use at most WEIGHTS_SHARE, the rest is KV cache and activations. With
# less than ~20 % left for the KV cache, long thinking-mode contexts cannot be served.
GPU_MEMORY_UTILIZATION = 0.9
WEIGHTS_SHARE = 0.8


def replica_memory_needed_gb(weights_gb: float) -> float:
    """GPU memory one replica must have in total so the weights leave room for the KV cache."""
    return round(weights_gb / (GPU_MEMORY_UTILIZATION * WEIGHTS_SHARE), 1)


@dataclass(frozen=True)
class InterfaceSlot:
    network_card_index: int
    device_index: int
    interface_type: str  # "efa" (EFA with ENA), "efa-only", or "interface" (ENA)


def interface_layout(kind: InstanceType, efa: bool) -> list[InterfaceSlot]:
    """AWS's recommended interfaces for an accelerated instance, one EFA device per card.

    "Maximize network bandwidth on accelerated instances"
    (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html): the
    primary interface (card 0, device 0) must carry an IP, so it is `efa` (EFA with ENA),
    never `efa-only`. Every further card gets `efa-only` at device 0 where AWS documents it
    (P5/P5e/P5en/P6: one IP per instance, the whole bandwidth for EFA); older types get a
    full `efa` interface at device 1 on each further card.
    """
    if not efa:
        return [InterfaceSlot(0, 0, "interface")]
    if not kind.efa:
        raise ValueError(f"{kind.name} has no EFA support")
    slots = [InterfaceSlot(0, 0, "efa")]
    for card in range(1, min(kind.network_cards, kind.max_efa_interfaces)):
        if kind.efa_only_interfaces:
            slots.append(InterfaceSlot(card, 0, "efa-only"))
        else:
            slots.append(InterfaceSlot(card, 1, "efa"))
    return slots


# The AWS Deep Learning Base GPU AMI, found by owner and name (DLAMI guide, "find-dlami-id").
DLAMI_OWNER = "amazon"
DLAMI_NAME_FILTER = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
