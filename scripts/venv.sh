#!/usr/bin/env bash
# The project's virtualenv (`make venv`), kept outside the clone and linked as .venv.
#
# Installing requirements.txt takes over a minute on the 2-core machines (pulumi-aws, moto, ...);
# a fresh clone (CI's, a worktree's) reuses the environment at once. It lives in the lab's cache
# root (QCL_LAB_CACHE, default /var/cache/qwen-cluster-lab: what CI caches), or under
# ~/.cache/qwen-cluster when that is not writable, keyed by requirements.txt and the Python that
# makes it: a changed requirement builds a new one, never changes one another clone uses.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

root=${QCL_LAB_CACHE:-/var/cache/qwen-cluster-lab}
if ! mkdir -p "$root" 2>/dev/null || [ ! -w "$root" ]; then
    root=${XDG_CACHE_HOME:-$HOME/.cache}/qwen-cluster
    mkdir -p "$root"
fi
key=$({ cat requirements.txt; "$python" -c 'import sys; print(sys.version, sys.executable)'; } | sha256sum | cut -c1-16)
target=$root/venv-$key

exec 9>"$target.lock"
flock 9 # two clones at once build it once
if [ ! -e "$target/.complete" ]; then
    rm -rf "$target"
    "$python" -m venv "$target"
    "$target/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements.txt
    touch "$target/.complete"
fi

if [ -e .venv ] && [ ! -L .venv ]; then
    rm -rf .venv # an environment of the earlier layout, built in the clone
fi
ln -sfn "$target" .venv
echo ".venv -> $target"
