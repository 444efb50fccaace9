"""Prometheus: the daemon's metric families and the /metrics endpoint."""
