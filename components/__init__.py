"""The ComponentResources: thin Pulumi components that register what qwen_cluster rendered.

`components.aws` builds the AWS target, `components.baremetal` the bare-metal one; neither holds a
text format or a rule of its own (those live in the pure core, `qwen_cluster`).
"""
