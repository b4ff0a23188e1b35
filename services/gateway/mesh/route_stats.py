"""What `/stats` shows of routing: the path that made each request's first token, retries, and how far the SLO
policy's predicted TTFT was from the actual one."""

from __future__ import annotations

import collections
import time

from common.policy.routing import PrefillPath, RoutePlan
from common.telemetry.metrics import GatewayMetrics

RECENT_PREDICTIONS = 1024  # routed requests whose predicted and actual TTFT /stats shows


class RouteStats:
    def __init__(self, metrics: GatewayMetrics | None = None):
        self.metrics = metrics
        self.paths = {path: 0 for path in PrefillPath}
        self.retries = 0
        # (seq, path, predicted, actual TTFT ms from arrival, request id) of the last requests the SLO policy routed
        self.predictions: collections.deque[tuple[int, str, float, float, str]] = collections.deque(
            maxlen=RECENT_PREDICTIONS
        )
        self.num_predictions = 0

    def first_token(self, plan: RoutePlan, arrival: float, request_id: str) -> None:
        """Count the path that made the request's first token, and how far the policy's prediction of it was off."""
        path = plan.path
        self.paths[path] += 1
        if self.metrics is not None:
            self.metrics.paths.labels(self.metrics.model, path.value).inc()
        if plan.predicted_ttft_ms is None:
            return
        actual = (time.monotonic() - arrival) * 1e3
        self.num_predictions += 1
        self.predictions.append(
            (self.num_predictions, path.value, round(plan.predicted_ttft_ms, 3), round(actual, 3), request_id)
        )
        if self.metrics is not None:
            self.metrics.prediction_error.labels(self.metrics.model, path.value).observe(
                (actual - plan.predicted_ttft_ms) / 1e3
            )

    def as_dict(self) -> dict:
        return {
            "paths": {p.value: n for p, n in self.paths.items()},
            "retries": self.retries,
            "ttft_predictions": {
                "fields": ["seq", "path", "predicted_ms", "actual_ms", "id"],
                "recent": list(self.predictions),
            },
        }
