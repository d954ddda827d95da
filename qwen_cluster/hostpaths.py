"""Where the program keeps its files on a node, on both targets: one definition for every
renderer and the config's defaults (the lab gives each node its own copy of these directories:
labkit/engine/substitutions.py)."""

from __future__ import annotations

# What the program writes for the node's services to read: nginx and proxy configs, the monitoring
# configs, the nftables rules, the model server's scripts and environment.
CONFIG_DIR = "/etc/qwen-cluster"
# What the scripts record to compare or undo later (firewall and SELinux records) and Prometheus's
# data.
STATE_DIR = "/var/lib/qwen-cluster"
# What can be fetched again (FHS /var/cache): the model weights.
CACHE_DIR = "/var/cache/qwen-cluster"
# The Hugging Face cache the model container mounts, staged before a rollout drains anything: the
# default of bareMetal.weightsCache and the AWS nodes' cache.
WEIGHTS_CACHE = f"{CACHE_DIR}/huggingface"
