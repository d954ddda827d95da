"""Trims a guidellm 0.8.1 JSON report to what labkit/cluster/guidellmbench.py figures_of reads
(and the prompt sizes, for a reader): `python tests/data/guidellm/trim.py REPORT > OUT`."""

import json
import sys
from pathlib import Path

KEPT = {
    "request_totals": None,
    "time_to_first_token_ms": ("successful",),
    "output_tokens_per_second": ("total",),
    "prompt_token_count": ("successful",),
}

report = json.loads(Path(sys.argv[1]).read_text())
(benchmark,) = report["benchmarks"]
metrics = {}
for name, statuses in KEPT.items():
    value = benchmark["metrics"][name]
    metrics[name] = value if statuses is None else {status: value[status] for status in statuses}
trimmed = {
    "metadata": report["metadata"],
    "benchmarks": [
        {
            "type_": benchmark["type_"],
            "config": {key: benchmark["config"][key] for key in ("strategy", "constraints")},
            "duration": benchmark["duration"],
            "metrics": metrics,
        }
    ],
}
print(json.dumps(trimmed, indent=1))
