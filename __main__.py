"""qwen-cluster: validate the stack config, build the cluster for its target, export outputs."""

import pulumi

from components import config, summary

try:
    cluster, ssh_private_key = config.from_pulumi()
except config.ConfigError as error:
    # Nothing has been registered yet: a bad config stops here, naming every mistake.
    raise pulumi.RunError(str(error)) from None

pulumi.export("summary", summary.summary(cluster))

if cluster.target is config.Target.BARE_METAL:
    from components import baremetal

    for name, value in baremetal.build(cluster, ssh_private_key).items():
        pulumi.export(name, value)
