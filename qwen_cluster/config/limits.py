"""Bounds the stack config enforces that other modules need too, each written once: the
section models, the cross-section rules, their messages, the AWS components and the policy
pack read them from here.
"""

from __future__ import annotations

# The guide: at least 2 GPU nodes, 4 or more recommended; at least 10 Gbit/s between them, 25
# better (the config refuses less than the minimum; the pack advises below the recommendation).
MIN_NODES = 2
RECOMMENDED_NODES = 4
MIN_BANDWIDTH_GBPS = 10
RECOMMENDED_BANDWIDTH_GBPS = 25

# AWS: an NLB's TCP idle timeout (tcp_idle_timeout_seconds, the listener attribute
# tcp.idle_timeout.seconds) is 60-6000 s
# (https://docs.aws.amazon.com/elasticloadbalancing/latest/network/update-idle-timeout.html).
NLB_IDLE_TIMEOUT_SECONDS = (60, 6000)
# Bare metal: nginx proxy_read_timeout / proxy_send_timeout, bounded here at one day.
NGINX_IDLE_TIMEOUT_SECONDS = (1, 86400)
IDLE_TIMEOUT_LIMITS = {"aws": NLB_IDLE_TIMEOUT_SECONDS, "bare-metal": NGINX_IDLE_TIMEOUT_SECONDS}

# AWS: a subnet is /16 to /28; the first four and the last address are reserved
# (https://docs.aws.amazon.com/vpc/latest/userguide/subnet-sizing.html).
AWS_SUBNET_PREFIX = (16, 28)
AWS_RESERVED_HEAD = 4
