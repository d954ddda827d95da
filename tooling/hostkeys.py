"""Pin a bare-metal stack's SSH host keys in one step: ask every node for its key, as
`ssh-keyscan` does, and write them into the stack file's `bareMetal.hostKeys`.

    scripts/hostkeys.py onprem            # print what each node answers
    scripts/hostkeys.py onprem --write    # and pin it in Pulumi.onprem.yaml (comments kept)

Run it from where `pulumi up` runs, over a network you trust for this one look (trust on first
use, as `ssh` itself asks you to): afterwards every connection, pulumi-command's and the docker
provider's, is refused unless the host proves it holds that key. With `bareMetal.bastion`, the
keys are asked for on the bastion (whose own key must be pinned), since only it reaches the nodes.
Exit codes: 0 every node answered, 1 some did not (nothing written), 2 a bad stack.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ruamel.yaml import YAML

from qwen_cluster import config
from qwen_cluster.sshhosts import known_host_options
from tooling import stackfile

# The key type pinned: ed25519, which every supported OpenSSH offers by default.
KEY_TYPE = "ssh-ed25519"
Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def keyscan_argv(cluster: config.ClusterConfig, ips: Sequence[str], timeout: int) -> list[str]:
    """`ssh-keyscan` of the node addresses, run on the bastion when the stack has one."""
    scan = ["ssh-keyscan", "-T", str(timeout), "-t", "ed25519", *ips]
    bastion = cluster.bare_metal.bastion
    if bastion is None:
        return scan
    if not bastion.host_key:
        raise ValueError(
            "bareMetal.bastion.hostKey is not set: pin the bastion's key first (its keys are not "
            "collected through itself)"
        )
    user = bastion.user or cluster.bare_metal.ssh_user
    return [
        "ssh",
        "-o",
        "BatchMode=yes",
        *known_host_options(bastion.host, bastion.port, bastion.host_key),
        "-p",
        str(bastion.port),
        f"{user}@{bastion.host}",
        " ".join(scan),
    ]


def parse_keyscan(output: str) -> dict[str, str]:
    """`ip ssh-ed25519 AAAA...` lines (comments, other types skipped) -> {ip: "ssh-ed25519 AAAA..."}."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 3 and not line.startswith("#") and parts[1] == KEY_TYPE:
            found.setdefault(parts[0], f"{parts[1]} {parts[2]}")
    return found


def collect(
    cluster: config.ClusterConfig, *, timeout: int = 5, run: Runner = _run
) -> tuple[dict[str, str], list[str]]:
    """{node name: key} for every node that answered, and the names of those that did not."""
    ips = {str(node.ip): node.name for node in cluster.nodes}
    done = run(keyscan_argv(cluster, list(ips), timeout))
    by_ip = parse_keyscan(done.stdout)
    keys = {ips[ip]: key for ip, key in by_ip.items() if ip in ips}
    missing = [name for name in ips.values() if name not in keys]
    return keys, missing


def write(path: Path, keys: dict[str, str]) -> None:
    """Set `qwen-cluster:bareMetal.hostKeys` in the stack file, keeping its comments and layout."""
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    document = yaml.load(path.read_text())
    bare_metal = document["config"].setdefault(f"{config.NAMESPACE}:bareMetal", {})
    pinned = bare_metal.get("hostKeys")
    if pinned is None:
        bare_metal["hostKeys"] = dict(keys)
    else:
        for name, key in keys.items():
            pinned[name] = key
    with path.open("w") as out:
        yaml.dump(document, out)


def main(argv: list[str] | None = None, *, run: Runner = _run, root: Path = stackfile.PROJECT_ROOT) -> int:
    parser = argparse.ArgumentParser(prog="hostkeys.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("stack")
    parser.add_argument("--write", action="store_true", help="pin the keys in the stack file")
    parser.add_argument("--timeout", type=int, default=5, help="seconds per host (ssh-keyscan -T)")
    args = parser.parse_args(argv)
    try:
        stack_config = stackfile.read(args.stack, root)
        # Validated without the pins it is about to replace: a stack may not have any yet.
        cluster = stackfile.validate(stack_config)
    except (FileNotFoundError, config.ConfigError) as error:
        print(error, file=sys.stderr)
        return 2
    if cluster.bare_metal is None:
        print(f"{args.stack} is not a bare-metal stack: it has no SSH hosts to pin", file=sys.stderr)
        return 2
    try:
        keys, missing = collect(cluster, timeout=args.timeout, run=run)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    for node in cluster.nodes:
        pinned = cluster.bare_metal.host_keys.get(node.name)
        if node.name in keys:
            change = "" if pinned is None else (" (as pinned)" if pinned == keys[node.name] else " (CHANGED)")
            print(f"{node.name} {node.ip}: {keys[node.name]}{change}")
        else:
            print(f"{node.name} {node.ip}: no answer", file=sys.stderr)
    if missing:
        print(f"not written: {', '.join(missing)} did not answer", file=sys.stderr)
        return 1
    if args.write:
        path = stackfile.stack_path(args.stack, root)
        write(path, keys)
        print(f"pinned {len(keys)} host keys in {path.name} (bareMetal.hostKeys)")
    return 0
