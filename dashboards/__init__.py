"""Operators' views of specgate: the Grafana dashboard as code, and a Prometheus to feed it.

``python -m dashboards.build`` renders ``dashboards/specgate.json``; ``python -m
dashboards.observe`` runs Prometheus against a gateway with ``deploy/``'s scrape config and
alert rules. See README "Watching it" and docs/metrics.md.
"""
