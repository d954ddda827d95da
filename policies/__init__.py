"""The CrossGuard policy pack `qwen-cluster-guard` (policies in `guard`, offline runner in `harness`)."""
