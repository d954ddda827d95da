"""The lab: a stack's cluster rehearsed in Linux network namespaces (root only), a second program
that reads the first through the offline render (tooling/offline.py) and the core (qwen_cluster).

Its rooms, lowest first; each imports only rooms before it (tests/test_layers.py):
`hosts` (a namespace made a host), `models` (the model servers and the router), `images` (the
images built in place of the real ones), `engine` (the Pulumi engine and providers as the lab
carries them out), `cluster` (the lab's cluster: build, check, roll, break), `aws` (the AWS node
side and its services); then the entry points `cli`, `bench`, `demo`. docs/developers.md has the map.
"""
