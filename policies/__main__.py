"""qwen-cluster-guard: the policy pack the CLI runs (`pulumi preview --policy-pack policies`).

Thin on purpose: the policies are declared in their group modules and listed by `policies.guard`,
all importable without starting a server.
"""

import sys
from pathlib import Path

# The pack judges against the project's own catalog and port table: make the repo importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

from policies.guard import PACK_NAME, POLICIES  # noqa: E402

PolicyPack(PACK_NAME, enforcement_level=EnforcementLevel.MANDATORY, policies=POLICIES)
