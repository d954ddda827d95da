"""Shared pieces of the rendered bash scripts: the strict header and safe quoting.

Signatures:
    script(purpose: str, body: str) -> str      a complete bash script (set -euo pipefail)
    quote(value: object) -> str                 one shell word (shlex.quote of str(value))
    os_family_function() -> str                 bash function `os_family` printing debian|rhel
    sha256(text: str) -> str                    the hex digest components use as triggers
"""

from __future__ import annotations

import hashlib
import shlex

HEADER = "#!/usr/bin/env bash\n# Rendered by qwen-cluster: {purpose}\nset -euo pipefail\n"


def script(purpose: str, body: str) -> str:
    return HEADER.format(purpose=purpose) + body.strip("\n") + "\n"


def quote(value: object) -> str:
    return shlex.quote(str(value))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def os_family_function(os_release: str = "/etc/os-release") -> str:
    """A bash function that prints the OS family (debian or rhel) or fails naming the OS."""
    return f"""
os_family() {{
  local id="" id_like=""
  # shellcheck disable=SC1091
  id=$(. {quote(os_release)} && echo "${{ID:-}}")
  # shellcheck disable=SC1091
  id_like=$(. {quote(os_release)} && echo "${{ID_LIKE:-}}")
  case " $id $id_like " in
    *" debian "* | *" ubuntu "*) echo debian ;;
    *" rhel "* | *" fedora "* | *" centos "*) echo rhel ;;
    *) echo "unsupported OS: ID=$id ID_LIKE=$id_like (need a Debian or RHEL family)" >&2; return 1 ;;
  esac
}}
"""
