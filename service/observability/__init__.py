"""Metrics, tracing and the request observer every door reports to."""
