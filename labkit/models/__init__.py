"""The model servers and the router: the vLLM stand-in (modelserver) and the metrics it writes as
vLLM does (servermetrics), the real vLLM's CPU build (realvllm) with its tiny Qwen3 model
(tinymodel), and vLLM's router from PyPI (router)."""
