"""The sysctl drop-in from `tuning.sysctl` (one file, never appended to /etc/sysctl.conf),
and the script that installs it, applies it and reads every value back.

Signatures:
    dropin(values: Mapping[str, int | str]) -> str
    apply_script(values, *, dropin_path: str = DROPIN_PATH, system: bool = True) -> str
    revert_script(*, dropin_path: str = DROPIN_PATH, system: bool = True) -> str

`system=True` applies with `sysctl --system` (so a later file that overrides ours is caught by
the read-back); `system=False` (or QWEN_SYSCTL_SCOPE=dropin at run time) applies only our
file (`sysctl -p <dropin>`), which is what a lab running inside `ip netns exec` wants: it
must not re-apply the host's own files. Keys a non-initial network namespace cannot set
(net.core.rmem_max lives in the initial namespace only) are reported as `namespace-exempt`
instead of failing; on a host they fail.
"""

from __future__ import annotations

from collections.abc import Mapping

from qwen_cluster.render.shell import quote, script

DROPIN_PATH = "/etc/sysctl.d/90-qwen-cluster.conf"


def dropin(values: Mapping[str, int | str]) -> str:
    """The drop-in's text: sorted, so the same config always yields the same bytes."""
    lines = ["# Managed by qwen-cluster (tuning.sysctl). Changes here are overwritten."]
    lines += [f"{key} = {values[key]}" for key in sorted(values)]
    return "\n".join(lines) + "\n"


def apply_script(
    values: Mapping[str, int | str], *, dropin_path: str = DROPIN_PATH, system: bool = True
) -> str:
    expected = "\n".join(f"{key}={' '.join(str(values[key]).split())}" for key in sorted(values))
    scope = "system" if system else "dropin"
    body = f"""
dropin={quote(dropin_path)}
wanted=$(mktemp)
trap 'rm -f "$wanted"' EXIT
cat >"$wanted" <<'QWEN_SYSCTL_EOF'
{dropin(values).rstrip(chr(10))}
QWEN_SYSCTL_EOF

mkdir -p "$(dirname "$dropin")"
if cmp -s "$wanted" "$dropin"; then
  echo "sysctl: $dropin is up to date"
else
  install -m 0644 "$wanted" "$dropin"
  echo "sysctl: wrote $dropin"
fi

# -e: unknown keys are not fatal here; the read-back below decides, key by key.
# QWEN_SYSCTL_SCOPE=dropin (the lab's hook): only our file, never the host's own files.
if [ "${{QWEN_SYSCTL_SCOPE:-{scope}}}" = dropin ]; then
  apply=(sysctl -e -p "$dropin")
else
  apply=(sysctl -e --system)
fi
if ! "${{apply[@]}}" >/dev/null 2>&1; then
  echo "sysctl: applying reported errors; checking our keys" >&2
fi

# A non-initial network namespace (the lab) has no per-namespace copy of some net.* keys.
# `ip netns exec` names it; otherwise compare with pid 1's namespace when we may read it.
in_child_netns=no
init_netns=$(readlink /proc/1/ns/net 2>/dev/null || true)
if [ -n "$(ip netns identify 2>/dev/null || true)" ] \
  || {{ [ -n "$init_netns" ] && [ "$(readlink /proc/self/ns/net)" != "$init_netns" ]; }}; then
  in_child_netns=yes
fi

failed=0
while IFS='=' read -r key want; do
  [ -n "$key" ] || continue
  got=""
  if value=$(sysctl -n "$key" 2>/dev/null); then
    got=$(echo "$value" | tr -s '[:space:]' ' ' | sed 's/ $//')
  fi
  if [ "$got" = "$want" ]; then
    echo "sysctl: $key = $got ok"
  elif [ "$in_child_netns" = yes ] && [ "${{key#net.}}" != "$key" ] \
    && {{ [ -n "$got" ] || [ "${{key#net.core.}}" != "$key" ]; }} \
    && ! echo "$want" 2>/dev/null >"/proc/sys/${{key//.//}}"; then
    # Global net.* keys (net.core.rmem_max) are read-only outside the initial namespace, or
    # absent there on older kernels (net.core.* only): the host sets them, not the namespace.
    echo "sysctl: $key namespace-exempt" \\
      "(a non-initial network namespace cannot set it; host has ${{got:-none}})"
  elif [ -z "$got" ]; then
    echo "sysctl: $key FAILED: the kernel has no such key (wanted $want)" >&2
    failed=1
  else
    echo "sysctl: $key FAILED: kernel has $got, wanted $want (overridden by a later file?)" >&2
    failed=1
  fi
done <<'QWEN_SYSCTL_EXPECTED'
{expected}
QWEN_SYSCTL_EXPECTED
exit "$failed"
"""
    return script("sysctl drop-in from tuning.sysctl, applied and read back", body)


def revert_script(*, dropin_path: str = DROPIN_PATH, system: bool = True) -> str:
    """Remove the drop-in. Values stay in the running kernel until the next boot or until
    another file sets them: there is no record of what they were before."""
    reload = "sysctl -e --system >/dev/null || true" if system else ":"
    body = f"""
dropin={quote(dropin_path)}
if [ -e "$dropin" ]; then
  rm -f "$dropin"
  echo "sysctl: removed $dropin (running values stay until reboot)"
fi
{reload}
"""
    return script("remove the qwen-cluster sysctl drop-in", body)
