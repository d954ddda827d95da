"""qwen-cluster: validate the stack config, build the cluster for its target, export outputs."""

import pulumi

from components import kvlink
from qwen_cluster import config, summary

try:
    cluster, ssh_private_key, endpoint_secrets = config.from_pulumi()
    ray_auth_token = config.ray_auth_token(cluster)  # an Output secret, or None without Ray
except config.ConfigError as error:
    # Nothing has been registered yet: a bad config stops here, naming every mistake.
    raise pulumi.RunError(str(error)) from None

pulumi.export("summary", summary.summary(cluster))

# A disaggregated stack declares its KV path for the policy pack (components/kvlink.py).
kvlink.declare(cluster)

if cluster.target is config.Target.AWS:
    from components import aws

    outputs = aws.build(cluster, endpoint_secrets, ray_auth_token=ray_auth_token)
else:
    from components import baremetal

    outputs = baremetal.build(cluster, ssh_private_key, endpoint_secrets, ray_auth_token=ray_auth_token)

for output_name, value in outputs.items():
    pulumi.export(output_name, value)
