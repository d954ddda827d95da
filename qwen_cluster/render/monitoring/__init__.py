"""Monitoring, rendered from the stack config: every node's :8000 endpoint, the cluster's
Prometheus (scrape config, alert rules) and Alertmanager, and the containers that run them.
Pure: text and data, no Pulumi. One module per job:

    clock.py         the scrape interval every monitoring duration scales with
    endpoint.py      the node endpoint (nodemetrics.py's config, peer probes, exporter arguments)
    prometheus.py    Prometheus's scrape config and command line
    alerts.py        the alert and recording rules (what doctor explains)
    alertmanager.py  Alertmanager's routes and command line
    containers.py    the containers for every target, the server files, the stack outputs
"""
