"""The offline render sends computed outputs only; the SDK fills in the inputs itself. Every
resource, input, output, dependency and stack output is the same as with the inputs echoed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tooling import bench, offline, stackfile


def recorded(render: offline.Render) -> dict:
    resources = []
    for resource in sorted(render.resources, key=lambda r: (r.type, r.name)):
        entry = dataclasses.asdict(resource)
        # The SDK lists a property's dependencies from a set: their order is not stable.
        entry["property_dependencies"] = {k: sorted(v) for k, v in resource.property_dependencies.items()}
        resources.append(entry)
    return json.loads(json.dumps({"resources": resources, "outputs": render.outputs}, default=repr))


@pytest.mark.parametrize(
    ("stack", "config"),
    [(stack, stackfile.read(stack)) for stack in stackfile.STACKS]
    + [("prod", bench.scaled_stack("prod", 12))],
    ids=[*stackfile.STACKS, "prod-12-nodes"],
)
def test_the_render_is_the_same_with_inputs_echoed(stack, config):
    fast = offline.render(config, stack)
    echoed = offline.render(config, stack, echo_inputs=True)
    assert fast.error is None and echoed.error is None
    assert recorded(fast) == recorded(echoed)
    assert len(fast.resources) > 40
