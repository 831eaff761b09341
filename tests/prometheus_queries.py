"""Queries against a real Prometheus's HTTP API (the observability and gateway tests)."""
from __future__ import annotations

import json
import urllib.parse
import urllib.request


def prom_query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def has_number(result: list[dict]) -> bool:
    return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in result)


def prom_query_ok(port: int, expr: str) -> bool:
    try:
        return bool(prom_query(port, expr))
    except OSError:
        return False
