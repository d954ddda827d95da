"""The CrossGuard policy pack `qwen-cluster-guard`: one module per policy group (bandwidth,
exposure, paths, efa, nodes, baseline, endpoint; facts holds what the stack intends), the registry in
`guard`. The offline runner is tooling/policy_harness.py.
"""
