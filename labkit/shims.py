"""The programs the lab answers itself inside a node's namespace (why: substitutions.SHIMS).

Run as `python -m labkit.shims NAME ARGS...` by the launchers `substitutions.
install_shims` writes; the launchers come first on PATH for the program's commands and the
stand-ins. The node comes from the environment the executor sets (QCL_LAB_*).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from labkit import standins


def _host() -> standins.Host:
    state = Path(os.environ["QCL_LAB_NODE_STATE"])
    return standins.Host(
        node=os.environ["QCL_LAB_NODE"],
        namespace=os.environ["QCL_LAB_NAMESPACE"],
        ip=os.environ.get("QCL_LAB_NODE_IP", ""),
        etc_root=os.environ["QCL_LAB_ETC"],
        state_dir=str(state),
        bin_dir=os.environ["QCL_LAB_BIN"],
        lab_env={key: value for key, value in os.environ.items() if key.startswith("QCL_LAB_")},
    )


def systemctl(args: list[str]) -> int:
    print(f"lab: systemctl {' '.join(args)}: skipped (no persistence in the lab)")
    return 0


def timedatectl(args: list[str]) -> int:
    if "NTPSynchronized" in " ".join(args):
        print("yes")
    else:
        print("System clock synchronized: yes (lab: one clock for every namespace)")
    return 0


def _signal(name: str) -> int:
    name = name.upper()
    if name.isdigit():
        return int(name)
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


# What the docker CLI says when /var/run/docker.sock (root:docker, 0660) refuses the user, and
# when no daemon listens on it (docker/cli: the client's connection errors). The launcher
# (substitutions.install_shims) applies the socket's rules before any Python starts: a user's
# process may not be able to run this machine's interpreter at all.
SOCKET = "unix:///var/run/docker.sock"
PERMISSION_DENIED = (
    f"permission denied while trying to connect to the Docker daemon socket at {SOCKET}: "
    'Get "http://%2Fvar%2Frun%2Fdocker.sock/v1.47/version": dial unix /var/run/docker.sock: '
    "connect: permission denied"
)
NO_DAEMON = f"Cannot connect to the Docker daemon at {SOCKET}. Is the docker daemon running?"
# A node's daemon is "down" while this file exists in its lab state (fault tests).
DAEMON_DOWN = "dockerd-down"
LAB_VERSION = "28.2.2-lab"


def docker_launcher(python_command: str) -> str:
    """The `docker` shim's launcher: the socket's rules, `docker version` for a user in group
    docker, then the Python handler below (as root: the program runs docker under sudo)."""
    return rf"""#!/bin/sh
if [ -e "$QCL_LAB_NODE_STATE/{DAEMON_DOWN}" ]; then
  echo {shlex.quote(NO_DAEMON)} >&2; exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  case " $(id -Gn) " in
    *" docker "*) ;;
    *) echo {shlex.quote(PERMISSION_DENIED)} >&2; exit 1 ;;
  esac
  if [ "${{1:-}}" = version ]; then echo {LAB_VERSION}; exit 0; fi
  echo "lab docker: as a user only \`docker version\` is modelled (the program runs docker as root)" >&2
  exit 125
fi
{python_command} docker "$@"
"""


# What `docker pull` leaves in a node's lab state: the lab has no registry, so a pull records
# the image, and `docker images`-like questions read these files (labkit/substitutions.py SHIMS).
IMAGES_DIR = "images"
# Where the weights-fetch stand-in writes, under the host cache the staging mounts: one JSON file
# per model, saying which image fetched it from where (the lab has no Hub and no mirror).
LAB_WEIGHTS_DIR = "lab-weights"


def _image_record(host: standins.Host, image: str) -> Path:
    return Path(host.state_dir) / IMAGES_DIR / image.replace("/", "_").replace(":", "@")


def pulled(state_dir: str) -> list[str]:
    """The images `docker pull` recorded on a lab node (its state directory)."""
    folder = Path(state_dir) / IMAGES_DIR
    return sorted(path.read_text() for path in folder.glob("*")) if folder.is_dir() else []


def _pull(host: standins.Host, image: str) -> None:
    record = _image_record(host, image)
    record.parent.mkdir(parents=True, exist_ok=True)
    standins.write_atomic(record, image)


def _weights_fetch(host: standins.Host, rest: list[str]) -> int:
    """`docker run --rm ... --entrypoint=python3 IMAGE -c <snapshot_download> MODEL`, the
    staging's weights fetch (qwen_cluster/render/weights.py): no Hub here, so the stand-in
    writes what would have been fetched, and from where, into the mounted host cache."""
    options: dict[str, list[str]] = {}
    index = 0
    while index < len(rest) and rest[index].startswith("--"):
        key, _, value = rest[index].partition("=")
        options.setdefault(key, []).append(value)
        index += 1
    image, words = rest[index], rest[index + 1 :]
    env = dict(item.partition("=")[::2] for item in options.get("--env", []))
    fetch = words[:1] == ["-c"] and "snapshot_download" in words[1] and len(words) == 3
    if "--rm" not in options or options.get("--entrypoint") != ["python3"] or not fetch:
        print(f"lab docker: `docker run {' '.join(rest)}` is not modelled (labkit/shims.py)", file=sys.stderr)
        return 125
    mounts = {}
    for volume in options.get("--volume", []):
        host_path, container_path = volume.split(":")[:2]
        mounts[container_path] = host_path
    cache = mounts.get(env.get("HF_HOME", ""))
    if cache is None:
        print("lab docker: the weights fetch mounts no HF_HOME (it would fill the image)", file=sys.stderr)
        return 1
    _pull(host, image)  # `docker run` pulls an image it lacks
    model = words[2]
    record = Path(cache) / LAB_WEIGHTS_DIR / f"{model.replace('/', '--')}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    endpoint = env.get("HF_ENDPOINT", "https://huggingface.co")
    standins.write_atomic(record, json.dumps({"model": model, "image": image, "endpoint": endpoint}))
    print(f"{cache}/hub/models--{model.replace('/', '--')} (lab stand-in: nothing downloaded)")
    return 0


def docker(args: list[str]) -> int:
    """The few docker commands a program's remote command may run against its containers."""
    if not args:
        print("lab docker: no command", file=sys.stderr)
        return 125
    command, rest = args[0], args[1:]
    host = _host()
    if command == "version":
        asked_server = "{{.Server.Version}}" in " ".join(rest)
        print(LAB_VERSION if asked_server else "Server: lab stand-ins (labkit/shims.py)")
        return 0
    try:
        if command == "pull":
            image = [word for word in rest if not word.startswith("-")][-1]
            _pull(host, image)
            print(f"{image} (lab: no registry, the pull is recorded)")
            return 0
        if command == "run":
            return _weights_fetch(host, rest)
        if command == "kill":
            sig = signal.SIGKILL
            names = []
            index = 0
            while index < len(rest):
                word = rest[index]
                if word in ("-s", "--signal"):
                    sig, index = _signal(rest[index + 1]), index + 2
                    continue
                if word.startswith("--signal="):
                    sig = _signal(word.split("=", 1)[1])
                elif not word.startswith("-"):
                    names.append(word)
                index += 1
            for name in names:
                print(standins.send(host, name, sig), file=sys.stderr)
                print(name)
            return 0
        if command == "exec":
            # docker exec [OPTIONS] CONTAINER COMMAND [ARG...]: the command's own words untouched.
            index = 0
            while index < len(rest) and rest[index].startswith("-"):
                takes_value = rest[index] in ("-u", "--user", "-e", "--env", "-w", "--workdir")
                index += 2 if takes_value else 1
            name, inner = rest[index], rest[index + 1 :]
            if inner[:3] == ["nginx", "-s", "reload"]:
                print(standins.send(host, name, signal.SIGHUP), file=sys.stderr)
                return 0
            if inner[:1] == ["nginx"] and "-t" in inner:
                done = standins.nginx_test(host, name)
                sys.stderr.write(done.stderr)
                return done.returncode
            print(f"lab docker: exec {' '.join(inner)} in {name} is not modelled", file=sys.stderr)
            return 126
        if command in ("restart", "start"):
            for name in [word for word in rest if not word.startswith("-")]:
                if command == "start" and standins.running(host, name):
                    print(name)
                    continue
                print(standins.restart(host, name), file=sys.stderr)
                print(name)
            return 0
        if command == "stop":
            for name in [word for word in rest if not word.startswith("-")]:
                print(standins.stop(host, name, grace=10.0), file=sys.stderr)
                print(name)
            return 0
        if command == "inspect":
            name = [word for word in rest if not word.startswith("-") and "{{" not in word][-1]
            if standins.read_record(host, name) is None:
                print("[]")
                print(f"Error: No such object: {name}", file=sys.stderr)  # docker's own words
                return 1
            if "{{.State.Running}}" in " ".join(rest):
                print("true" if standins.running(host, name) else "false")
            return 0
    except standins.StandInError as error:
        print(error, file=sys.stderr)
        return 1
    print(
        f"lab docker: `docker {command}` is not modelled by the lab (labkit/shims.py)",
        file=sys.stderr,
    )
    return 125


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    """`--name value` or `--name=value` (the last one wins, as argparse's)."""
    found = default
    for index, word in enumerate(args):
        if word == name and index + 1 < len(args):
            found = args[index + 1]
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
    return found


def vllm(args: list[str]) -> int:
    """`vllm serve MODEL ...` -> the stand-in model server (labkit/modelserver.py), with vLLM
    0.33.0's multi-node launch: `--nnodes N --node-rank R --master-addr A --master-port P`, the
    head (rank 0) serving the API once its members joined P, a `--headless` member serving no
    HTTP. The launch errors vLLM raises itself are raised here with its words
    (vllm/config/parallel.py, vllm/engine/arg_utils.py, vllm/entrypoints/cli/serve.py)."""
    if not args or args[0] != "serve":
        print(f"lab vllm: only `vllm serve` is modelled, not {' '.join(args)}", file=sys.stderr)
        return 2
    model = args[1] if len(args) > 1 and not args[1].startswith("-") else "Qwen/Qwen3-32B"
    nnodes = int(_flag(args, "--nnodes", "1"))
    rank = int(_flag(args, "--node-rank", "0"))
    backend = _flag(args, "--distributed-executor-backend")
    headless = "--headless" in args
    api_servers = _flag(args, "--api-server-count")
    if nnodes > 1 and backend not in (None, "mp", "uni", "external_launcher"):
        print("ValueError: nnodes > 1 can only be set when distributed executor backend is mp, uni "
              "or external_launcher.", file=sys.stderr)
        return 1
    if not 0 <= rank < nnodes:
        print(f"ValueError: Invalid data-parallel launch options: `--node-rank` must be between 0 and "
              f"{nnodes - 1}; got `--node-rank {rank}`.", file=sys.stderr)
        return 1
    if headless and api_servers is not None and int(api_servers) > 0:
        print(f"ValueError: --api-server-count={api_servers} cannot be used with --headless",
              file=sys.stderr)
        return 1
    env = os.environ
    clock = float(env.get("QCL_LAB_CLOCK", "1"))
    node = env.get("QCL_LAB_NODE", "?")
    argv = [sys.executable, "-m", "labkit.modelserver", "--node", node]
    master = f"{_flag(args, '--master-addr', '127.0.0.1')}:{_flag(args, '--master-port', '29501')}"
    if headless:
        print(f"lab vllm: headless stand-in (rank {rank} of {nnodes}) joining {master}", flush=True)
        os.execv(sys.executable, [*argv, "--join", master, "--host", _flag(args, "--host", "0.0.0.0")])
        return 0
    argv += ["--host", _flag(args, "--host", "0.0.0.0"), "--port", _flag(args, "--port", "8000")]
    argv += ["--model", model]
    if nnodes > 1:
        argv += ["--master-port", master.rsplit(":", 1)[1], "--members", str(nnodes - 1)]
    shutdown = float(_flag(args, "--shutdown-timeout", "0"))
    argv += [
        "--token-delay",
        env.get("QCL_LAB_TOKEN_DELAY", "0"),
        "--load-delay",
        env.get("QCL_LAB_LOAD_DELAY", "0"),
        "--shutdown-timeout",
        f"{shutdown * clock:g}",  # on the lab clock, as the container's stop grace is
    ]
    argv += ["--image", env.get("QCL_LAB_IMAGE", "")]
    print(f"lab vllm: stand-in for `vllm serve {' '.join(args[1:])}`", flush=True)
    os.execv(sys.executable, argv)
    return 0


def _raylet_pidfile() -> Path:
    state = Path(os.environ.get("QCL_LAB_NODE_STATE") or tempfile.gettempdir())
    return state / f"raylet-{os.environ.get('QCL_LAB_CONTAINER', 'ray')}.pid"


def ray(args: list[str]) -> int:
    """`ray start` as Ray 2.60 does it, as far as the program's launch can tell: it returns once
    the node runs, leaving its raylet behind (here a process named `raylet`, which the rendered
    worker's watch looks for: qwen_cluster/render/vllm.py RAYLET_WATCH); `ray stop` ends it;
    `--block` holds the command (an image's own launch may still use it)."""
    # As Ray 2.52+ does: in token mode `ray start` refuses to run without a token
    # (ray-project/ray python/ray/tests: test_ray_start_without_token_raises_error).
    if os.environ.get("RAY_AUTH_MODE") == "token" and not (
        os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    ):
        print("lab ray: RAY_AUTH_MODE=token and no RAY_AUTH_TOKEN: refused", file=sys.stderr)
        return 1
    if "--ray-client-server-port" in " ".join(args):
        # Ray without ray[client] (grpcio), as measured with 2.60.
        print("lab ray: Ray Client requires pip package `ray[client]`", file=sys.stderr)
        return 1
    if args[:1] == ["stop"]:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(_raylet_pidfile().read_text()), signal.SIGTERM)
        print("lab ray: stopped")
        return 0
    if "--block" in args:
        print("lab ray: holding like `ray start --block`", flush=True)
        signal.pause()
    if args[:1] == ["start"]:
        # A process whose name is `raylet`: `sleep` started through a link of that name.
        link = _raylet_pidfile().with_suffix(".bin") / "raylet"
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            link.symlink_to(shutil.which("sleep") or "/bin/sleep")
        # Started through a shell that exits at once, so the raylet is nobody's child here
        # (as Ray's daemonised raylet): whoever ends it, init reaps it.
        started = subprocess.run(
            ["sh", "-c", '"$0" infinity </dev/null >/dev/null 2>&1 & echo $!', str(link)],
            capture_output=True, text=True, check=True, start_new_session=True,
        )
        _raylet_pidfile().write_text(started.stdout.strip())
    print(f"lab ray: `ray {' '.join(args)}`: ok")
    return 0


HANDLERS = {
    "systemctl": systemctl,
    "timedatectl": timedatectl,
    "docker": docker,
    "vllm": vllm,
    "ray": ray,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return HANDLERS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
