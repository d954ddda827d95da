"""The link a disaggregated cluster needs: how fast its prefill pool makes KV cache, and whether the
prefill->decode path carries it. Pure arithmetic from the model's geometry and the GPUs' figures;
the config rules, the policy pack, `doctor` and the docs (docs/disaggregation.md) all read it here.

A prompt's KV is `tokens x kv_bytes_per_token` on the wire. A prefill GPU computes
`MFU x peak FLOPS / FLOPs per token` tokens a second, so its KV leaves at
`tokens/s x kv_bytes_per_token x 8` bit/s. A prefill node sends what all its GPUs make; a decode
node receives what its share of the prefill pool sends. The transfer of one prompt takes
`share` of that prompt's prefill time, where `share = KV rate / link rate`: above 1 the link falls
behind for good (refused); above TRANSFER_SHARE the transfer is a visible part of the time to first
token (advisory).
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen_cluster import catalog

# The share of peak FLOPS a prefill reaches: prefill is compute-bound, and 50 % MFU is what
# well-tuned BF16 prefill of a dense model reaches on H100-class GPUs (the figure the design's
# arithmetic uses: ~7.5k tokens/s per H100 for Qwen3-32B). A higher MFU raises the floor.
PREFILL_MFU = 0.5
# Above this share of the prefill time the transfer is an advisory: "keeping the transfer under a
# tenth of the prefill" is the design's bar (docs/disaggregation.md).
TRANSFER_SHARE = 0.1
# KV dtypes by vLLM's `--kv-cache-dtype` (vllm/config/cache.py CacheDType): `auto` is the model's
# own dtype (BF16 for both catalog models), the fp8 spellings store one byte per value.
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def kv_dtype_bytes(kv_cache_dtype: object) -> int:
    """Bytes per stored K or V value for a `--kv-cache-dtype` flag value (None: the default, auto)."""
    return 1 if str(kv_cache_dtype or "auto") in FP8_KV_DTYPES else 2


def prefill_tokens_per_second(
    gpu: catalog.Gpu, model: catalog.ModelWeights, mfu: float = PREFILL_MFU
) -> float:
    """Prompt tokens one GPU prefills a second: MFU x dense BF16 peak / FLOPs per token."""
    return mfu * gpu.bf16_dense_tflops * 1e12 / model.prefill_flops_per_token


def kv_gbps(tokens_per_second: float, kv_bytes_per_token: int) -> float:
    """The KV a stream of prefilled tokens makes, in Gbit/s."""
    return tokens_per_second * kv_bytes_per_token * 8 / 1e9


def transfer_seconds(tokens: int, kv_bytes_per_token: int, link_gbps: float) -> float:
    """How long one prompt's KV takes on a link of `link_gbps` (serialisation only)."""
    return tokens * kv_bytes_per_token * 8 / (link_gbps * 1e9)


@dataclass(frozen=True)
class LinkDemand:
    """What a disaggregated stack's prefill pool makes and what its links carry."""

    model: str
    kv_bytes_per_token: int
    tokens_per_second_per_gpu: float
    rate_source: str  # where tokens_per_second_per_gpu came from, said in every message
    prefill_gpus_per_node: int
    prefill_nodes: int
    decode_nodes: int
    link_gbps: float  # per node, both pools (the bandwidth class)
    link_source: str

    @property
    def kv_gbps_per_prefill_node(self) -> float:
        return kv_gbps(self.tokens_per_second_per_gpu * self.prefill_gpus_per_node, self.kv_bytes_per_token)

    @property
    def prefill_share(self) -> float:
        """Transfer time over prefill time on a prefill node's own link."""
        return self.kv_gbps_per_prefill_node / self.link_gbps

    @property
    def decode_share(self) -> float:
        """The same on the decode pool's links, which receive the whole prefill pool's KV."""
        return self.prefill_nodes * self.kv_gbps_per_prefill_node / (self.decode_nodes * self.link_gbps)

    @property
    def share(self) -> float:
        return max(self.prefill_share, self.decode_share)

    @property
    def floor_gbps(self) -> float:
        """The least per-node link that carries the KV at all (share 1)."""
        return self.link_gbps * self.share

    @property
    def advised_gbps(self) -> float:
        """The per-node link that keeps the transfer within TRANSFER_SHARE of the prefill."""
        return self.advised_for(TRANSFER_SHARE)

    def advised_for(self, share: float) -> float:
        """The per-node link that keeps the transfer within `share` of the prefill time."""
        return self.floor_gbps / share

    @property
    def carried(self) -> bool:
        return self.share <= 1.0

    def figures(self, share: float = TRANSFER_SHARE) -> str:
        """The arithmetic in one line, for messages: every number a reader needs to redo it
        (`share`: the bar the last figure is given for, TRANSFER_SHARE unless a policy says)."""
        return (
            f"{self.model} holds {self.kv_bytes_per_token:,} B of KV per token; "
            f"{self.rate_source} prefills ~{self.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, so a "
            f"prefill node's {self.prefill_gpus_per_node} GPUs make "
            f"{self.kv_gbps_per_prefill_node:,.1f} Gbit/s of KV; {self.prefill_nodes} prefill and "
            f"{self.decode_nodes} decode nodes on {self.link_gbps:g} Gbit/s ({self.link_source}): the "
            f"transfer takes {self.share:.0%} of the prefill time (link floor "
            f"{self.floor_gbps:,.1f} Gbit/s per node, {self.advised_for(share):,.0f} Gbit/s to keep it under "
            f"{share:.0%})"
        )


# The document a disaggregated stack registers for the policy pack (`declaration`, registered by
# components/kvlink.py): what the link floor is derived from, so that a pack started without the
# stack config (`pulumi policy analyze`) judges the same figures. Over gRPC its numbers arrive as
# doubles; `demand_of` reads them either way.
SCHEMA = "qwen-cluster/kv-link@1"
# The type token of the component that carries it (components/kvlink.py), as the pack finds it.
DECLARATION_TYPE = "qwen-cluster:serving:KvLink"


def declaration(cluster) -> dict | None:
    """What a validated ClusterConfig with serving.mode disaggregated declares about its KV path,
    as plain data (None when aggregated):

        {"schema": "qwen-cluster/kv-link@1", "target": "aws", "model": "Qwen/Qwen3-32B",
         "kvCacheDtype": "auto", "gpuModel": "H100", "backend": "libfabric",
         "prefill": {"nodes": ["master", "worker-1"], "tensorParallel": 8, "tokensPerSecondPerGpu": null},
         "decode": {"nodes": ["worker-2", "worker-3"], "tensorParallel": 8},
         "linkGbps": 3200, "linkSource": "aws.instanceType p5.48xlarge"}
    """
    serving = cluster.serving
    if serving.mode != "disaggregated" or serving.prefill is None or serving.decode is None:
        return None
    tensor_parallel = cluster.model.tensor_parallel
    return {
        "schema": SCHEMA,
        "target": cluster.target.value,
        "model": cluster.model.name,
        "kvCacheDtype": str(cluster.model.vllm_flags.get("--kv-cache-dtype") or "auto"),
        "gpuModel": cluster.gpu_model,
        "backend": cluster.kv_backend,
        "prefill": {
            "nodes": list(serving.prefill.nodes),
            "tensorParallel": serving.pool_tensor_parallel("prefill", tensor_parallel),
            "tokensPerSecondPerGpu": serving.prefill.tokens_per_second_per_gpu,
        },
        "decode": {
            "nodes": list(serving.decode.nodes),
            "tensorParallel": serving.pool_tensor_parallel("decode", tensor_parallel),
        },
        "linkGbps": cluster.bandwidth_gbps,
        "linkSource": (
            f"aws.instanceType {cluster.aws.instance_type}" if cluster.aws else "bareMetal.nicSpeedGbps"
        ),
    }


def demand_of(declared) -> LinkDemand | None:
    """The link demand of a `declaration` (a plain dict, or one read back over gRPC with every
    number a double), else None when its figures are unknown: a model or GPU outside the catalog.
    Raises ValueError/TypeError/KeyError on a document that is not a declaration."""
    model = catalog.MODELS.get(str(declared["model"]))
    if model is None:
        return None
    kv_bytes = model.kv_bytes_per_token(kv_dtype_bytes(declared.get("kvCacheDtype")))
    prefill, decode = declared["prefill"], declared["decode"]
    rate = prefill.get("tokensPerSecondPerGpu")
    if rate is not None:
        rate, source = float(rate), "serving.prefill.tokensPerSecondPerGpu"
    else:
        gpu = catalog.gpu(str(declared.get("gpuModel") or ""))
        if gpu is None:
            return None
        rate = prefill_tokens_per_second(gpu, model)
        source = f"one {gpu.name} ({gpu.bf16_dense_tflops:g} TFLOPS BF16 at {PREFILL_MFU:.0%} MFU)"
    return LinkDemand(
        model=model.name,
        kv_bytes_per_token=kv_bytes,
        tokens_per_second_per_gpu=rate,
        rate_source=source,
        prefill_gpus_per_node=_whole(prefill["tensorParallel"]),
        prefill_nodes=len(list(prefill["nodes"])),
        decode_nodes=len(list(decode["nodes"])),
        link_gbps=float(declared["linkGbps"]),
        link_source=str(declared["linkSource"]),
    )


def _whole(value: object) -> int:
    """An integral number, as the config wrote it or as gRPC delivers it (8.0)."""
    number = float(value)  # type: ignore[arg-type]
    if not number.is_integer() or number < 1:
        raise ValueError(f"{value!r} is not a whole number of GPUs")
    return int(number)


def demand(cluster) -> LinkDemand | None:
    """The link demand of a validated ClusterConfig with serving.mode disaggregated, else None
    (also None when the figures are unknown: a model or GPU outside the catalog, which the config
    rules refuse by name). The same arithmetic as the policy pack's, through `declaration`."""
    declared = declaration(cluster)
    return demand_of(declared) if declared is not None else None
