"""Observability shared by the gateway and the replica: structlog setup, Prometheus metrics,
and the one-record-per-request log with token IDs."""
