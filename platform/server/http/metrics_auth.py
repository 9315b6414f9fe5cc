"""Who may read /metrics: anyone when no `metrics_key` is set, else a scrape with `Authorization: Bearer
<metrics_key>` (what Prometheus sends with `authorization: {credentials: ...}` in its scrape config)."""
from __future__ import annotations

from loramux.constant_time import same_secret
from loramux.server.http.ingress import bearer_token


def scrape_allowed(metrics_key: str, authorization: str | None) -> bool:
    return not metrics_key or same_secret(metrics_key, bearer_token(authorization))
