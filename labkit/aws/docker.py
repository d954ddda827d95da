"""The docker CLI on an AWS lab node, until the lab runs a dockerd per node (branch `docker`,
labkit/dockerd.py): the commands the program's SSM documents run, acting on the lab's container
stand-ins (labkit/standins.py) as dockerd would act on containers.

Modelled: `ps` (`--all`, `--quiet`, filters `name=`, `label=K=V`, `ancestor=IMAGE`), `pull`
(recorded), `run --detach` (`--name`, `--label`, `--env-file`, `--volume`, `--entrypoint`, the
image, its arguments; a name in use is docker's Conflict), `run --rm` of the staging's weights
fetch (labkit/shims.py), `stop --time`, `rm --force`, `exec NAME nginx -t ...`, `kill --signal`.
Host paths a container mounts are read where the node keeps them (its /etc and /opt layers,
labkit/aws/machine.py). Anything else fails with exit 125, naming itself.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from labkit import shims, standins


def _host() -> standins.Host:
    return standins.Host(
        node=os.environ["QCL_LAB_NODE"],
        namespace=os.environ["QCL_LAB_NAMESPACE"],
        ip=os.environ.get("QCL_LAB_NODE_IP", ""),
        etc_root=os.environ["QCL_LAB_ETC"],
        state_dir=os.environ["QCL_LAB_NODE_STATE"],
        bin_dir=os.environ["QCL_LAB_BIN"],
        lab_env={key: value for key, value in os.environ.items() if key.startswith("QCL_LAB_")},
    )


def node_path(path: str) -> str:
    """A host path of the node as a process outside its mount namespace finds it: the node's
    own layer (machine.py) when the node wrote it, else the machine's file."""
    layers = Path(os.environ.get("QCL_LAB_NODE_FS", ""))
    for top in ("/etc", "/opt"):
        if path == top or path.startswith(top + "/"):
            candidate = layers / path.lstrip("/")
            if candidate.exists():
                return str(candidate)
    return path


def _options(words: list[str], takes_value: set[str]) -> tuple[dict[str, list[str]], list[str]]:
    options: dict[str, list[str]] = {}
    index = 0
    while index < len(words) and words[index].startswith("-"):
        word = words[index]
        key, has, value = word.partition("=")
        if not has and key in takes_value:
            value, index = words[index + 1], index + 1
        options.setdefault(key, []).append(value)
        index += 1
    return options, words[index:]


_RUN_VALUES = {
    "--name",
    "--label",
    "--env-file",
    "--volume",
    "-v",
    "--entrypoint",
    "--env",
    "-e",
    "--restart",
}


def _records(host: standins.Host) -> list[standins.Record]:
    found = []
    for path in sorted(host.containers.glob("*.json")) if host.containers.is_dir() else []:
        record = standins.read_record(host, path.stem)
        if record is not None:
            found.append(record)
    return found


def ps(host: standins.Host, words: list[str]) -> int:
    options, _ = _options(words, {"--filter", "-f", "--format"})
    every = "--all" in options or "-a" in options
    filters = options.get("--filter", []) + options.get("-f", [])
    for record in _records(host):
        running = standins.alive(record.pid)
        if not running and not every:
            continue
        labels = record.container.get("labels") or {}
        keep = True
        for item in filters:
            kind, _, wanted = item.partition("=")
            if kind == "name":
                keep &= re.search(wanted, record.name) is not None
            elif kind == "label":
                key, has, value = wanted.partition("=")
                keep &= key in labels and (not has or labels[key] == value)
            elif kind == "ancestor":
                keep &= record.container.get("image") == wanted
            else:
                print(f"lab docker: filter {kind} is not modelled", file=sys.stderr)
                return 125
        if keep:
            print(record.name if "--quiet" in options or "-q" in options else f"{record.pid} {record.name}")
    return 0


def run(host: standins.Host, words: list[str]) -> int:
    if "--rm" in words:
        return shims._weights_fetch(host, [node_option(word) for word in words])
    options, rest = _options(words, _RUN_VALUES)
    if "--detach" not in options and "-d" not in options:
        print("lab docker: only `docker run --detach` (and the weights fetch) are modelled", file=sys.stderr)
        return 125
    image, arguments = rest[0], rest[1:]
    name = options.get("--name", [""])[0]
    volumes = {}
    for spec in options.get("--volume", []) + options.get("-v", []):
        host_path, container_path = spec.split(":")[:2]
        volumes[container_path] = node_path(host_path)
    for spec in options.get("--mount", []):
        fields = dict(item.partition("=")[::2] for item in spec.split(","))
        if fields.get("type") == "bind" and fields.get("source") and fields.get("target"):
            volumes[fields["target"]] = node_path(fields["source"])
    env = {}
    for env_file in options.get("--env-file", []):
        for line in Path(node_path(env_file)).read_text().splitlines():
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                env[key] = value
    for item in options.get("--env", []) + options.get("-e", []):
        key, _, value = item.partition("=")
        env[key] = value
    labels = dict(item.partition("=")[::2] for item in options.get("--label", []))
    # A file mounted at a path given as an argument (the server script) is read where the node
    # keeps it; paths under a mounted directory are left to the stand-in (nginx's -c).
    mapped = [volumes.get(word, word) if word in volumes and Path(volumes[word]).is_file() else word
              for word in arguments]  # fmt: skip
    container = standins.Container(
        resource=name,
        name=name,
        image=image,
        entrypoints=options.get("--entrypoint", []),
        command=mapped,
        env=env,
        uploads={},
        volumes=volumes,
        labels=labels,
        stop_signal=None,
        destroy_grace_seconds=0,
    )
    _pull(host, image)
    detail, record = standins.start(container, host)
    print(detail, file=sys.stderr)
    print(f"lab{record.pid:060d}")
    return 0


def node_option(word: str) -> str:
    """`--volume=HOST:CONTAINER` with the host side where the node keeps it."""
    if word.startswith("--volume="):
        host_path, _, rest = word[len("--volume=") :].partition(":")
        return f"--volume={node_path(host_path)}:{rest}"
    return word


def _pull(host: standins.Host, image: str) -> None:
    shims._pull(host, image)


def main(argv: list[str]) -> int:
    if not argv:
        print("lab docker: no command", file=sys.stderr)
        return 125
    command, rest = argv[0], argv[1:]
    host = _host()
    try:
        if command == "ps":
            return ps(host, rest)
        if command == "run":
            return run(host, rest)
        if command == "pull":
            image = [word for word in rest if not word.startswith("-")][-1]
            _pull(host, image)
            print(f"{image} (lab: no registry, the pull is recorded)")
            return 0
        if command == "stop":
            options, names = _options(rest, {"--time", "-t"})
            grace = float((options.get("--time") or options.get("-t") or ["10"])[0])
            for name in names:
                if standins.read_record(host, name) is None:
                    print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
                    return 1
                _stop_keep(host, name, grace)
                print(name)
            return 0
        if command == "rm":
            _, names = _options(rest, set())
            for name in names:
                if standins.read_record(host, name) is None:
                    print(f"Error: No such container: {name}", file=sys.stderr)
                    return 1
                standins.stop(host, name, grace=0)
                print(name)
            return 0
        if command in ("exec", "kill", "inspect", "version", "restart", "start"):
            return shims.docker(argv)
    except standins.StandInError as error:
        print(error, file=sys.stderr)
        return 125
    print(
        f"lab docker: `docker {command}` is not modelled on AWS nodes (labkit/aws/docker.py)", file=sys.stderr
    )
    return 125


def _stop_keep(host: standins.Host, name: str, grace: float) -> None:
    """`docker stop`: the stop signal, SIGKILL after `grace`; the container stays (stopped) for
    `ps --all` until `docker rm`."""
    record = standins.read_record(host, name)
    if record is None or not standins.alive(record.pid):
        return
    text = standins.record_path(host, name).read_text()
    standins.stop(host, name, grace=grace)
    standins.write_atomic(standins.record_path(host, name), text)  # stopped, not removed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
