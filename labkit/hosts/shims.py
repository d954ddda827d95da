"""The programs the lab answers itself inside a node's namespace (why: substitutions.SHIMS).

Run as `python -m labkit.hosts.shims NAME ARGS...` by the launchers `substitutions.install_shims`
writes; the launchers come first on PATH in every SSH session of a node. Containers are not
shimmed: each node runs a real Docker engine (labkit/hosts/dockerd.py).
"""

from __future__ import annotations

import sys


def systemctl(args: list[str]) -> int:
    print(f"lab: systemctl {' '.join(args)}: skipped (no persistence in the lab)")
    return 0


def timedatectl(args: list[str]) -> int:
    if "NTPSynchronized" in " ".join(args):
        print("yes")
    else:
        print("System clock synchronized: yes (lab: one clock for every namespace)")
    return 0


HANDLERS = {"systemctl": systemctl, "timedatectl": timedatectl}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return HANDLERS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
