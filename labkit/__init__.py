"""The lab: a stack's cluster network rehearsed in Linux network namespaces (root only).

`plan` is pure (what to build), `netns` drives `ip`, `renderers` is the one seam to the
project's renderers, `modelserver` is the stand-in model, `probes` measure, `lab` builds,
checks and tears down, `report` prints.
"""
