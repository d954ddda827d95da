"""What a `pulumi up` would do to a running stack, decided offline from two renders.

- rules.py: the one table (`RULES`) of how each provider carries out a change to a resource
  type, update in place or replace, each rule citing the provider source that decides it;
- compare.py: `diff(old, new)`, per resource of two offline renders (tooling/offline.py), what
  the engine would do, by those rules and the resource options the program set;
- impact.py: `rollout(old, new, changes)`, what that does to serving: nodes replaced, model
  servers restarted, replicas drained, the most replicas out of service at once given the
  engine's dependency order, and whether the endpoint stays up; `verdict` turns it into the
  plan's exit code;
- edit.py: `apply_changes`, a stack file's config with `--change KEY=VALUE` applied.

scripts/plan.py (tooling/preview.py) prints the plan; the lab executor (labkit) replays it.
"""

from tooling.changes.compare import Action, Change, Strategy, diff, fixed_identity
from tooling.changes.edit import ChangeSyntaxError, apply_changes, parse_change, shown
from tooling.changes.impact import (
    DRAIN_SUFFIXES,
    HEALTH_GATE_SUFFIXES,
    ROLLOUT_STEP_SUFFIXES,
    Rollout,
    is_health_gate,
    owners,
    rollout,
    verdict,
    waits_on_create,
)
from tooling.changes.rules import ALL, PROVIDER_RULE_SOURCE, RULES, Rule, UnknownResourceType, rule_for

__all__ = [
    "ALL",
    "DRAIN_SUFFIXES",
    "HEALTH_GATE_SUFFIXES",
    "PROVIDER_RULE_SOURCE",
    "ROLLOUT_STEP_SUFFIXES",
    "RULES",
    "Action",
    "Change",
    "ChangeSyntaxError",
    "Rollout",
    "Rule",
    "Strategy",
    "UnknownResourceType",
    "apply_changes",
    "diff",
    "fixed_identity",
    "is_health_gate",
    "owners",
    "parse_change",
    "shown",
    "rollout",
    "rule_for",
    "verdict",
    "waits_on_create",
]
