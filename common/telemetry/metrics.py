"""Prometheus metrics of the gateway and of each worker, under vLLM's names with an `epdmesh:` prefix
where the meaning is the same (`time_to_first_token_seconds`, `inter_token_latency_seconds`, …).

Each process builds its own registry (tests run several workers in one process); the gateway serves
it on its HTTP port at `/metrics`, a worker on its own `--metrics-port`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

P = "epdmesh:"
# vLLM's buckets, with finer ones at the low end (small models on CPUs answer in milliseconds)
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
# actual − predicted TTFT of a routed request: negative when the policy was pessimistic
PREDICTION_ERROR_BUCKETS = (
    -1.0,
    -0.5,
    -0.25,
    -0.1,
    -0.05,
    -0.025,
    -0.01,
    0.0,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, model_name: str, ttft_slo_s: float, tbt_slo_s: float, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.model = model_name
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        m = ["model_name"]
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.running = Gauge(P + "num_requests_running", "Requests in flight through the gateway.", m, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens generated for finished requests.", m, registry=r
        )
        self.success = Counter(
            P + "request_success", "Finished requests by finish reason.", m + ["finished_reason"], registry=r
        )
        self.errors = Counter(
            P + "request_errors", "Requests answered with an error, by HTTP status.", m + ["status"], registry=r
        )
        self.paths = Counter(P + "route_decisions", "Routing decisions by prefill path.", m + ["path"], registry=r)
        self.trace_lines = Counter(
            P + "trace_lines",
            "Requests the recorded trace took (--record-trace), and lines its file or Redis lost.",
            m + ["outcome"],
            registry=r,
        )
        self.retries = Counter(
            P + "request_retries", "Times a request was routed again around a failed worker.", m, registry=r
        )
        self.hand_backs = Counter(
            P + "request_hand_backs",
            "Times a decoder preempted a request it could not recompute and the gateway continued it elsewhere.",
            m,
            registry=r,
        )
        self.waiting_for_room = Gauge(
            P + "num_requests_waiting_for_room",
            "Requests waiting in the gateway for a worker with KV room (queued: every worker is full).",
            m,
            registry=r,
        )
        self.prediction_error = Histogram(
            P + "ttft_prediction_error_seconds",
            "First token's actual minus the SLO-aware policy's predicted time from "
            "arrival, per prefill path (positive: later than predicted).",
            m + ["path"],
            buckets=PREDICTION_ERROR_BUCKETS,
            registry=r,
        )
        self.first_token_hold = Histogram(
            P + "first_token_hold_seconds",
            "How long a handed-over request's first token was held to go out with its second (--first-token-hold).",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.slo = Counter(
            P + "slo_requests",
            "Finished requests by SLO outcome (TTFT ≤ ttft_ms and P90 TBT ≤ tbt_ms).",
            m + ["outcome"],
            registry=r,
        )
        self.planner_decisions = Counter(
            P + "planner_decisions",
            "The planner's decisions by action (switch, hold, idle, fixed).",
            m + ["action"],
            registry=r,
        )
        self.role_switches = Counter(
            P + "role_switches",
            "Workers the planner switched, by role set before and after.",
            m + ["from", "to"],
            registry=r,
        )
        for outcome in ("attained", "ttft_violated", "tbt_violated"):
            self.slo.labels(model_name, outcome)
        self.running.labels(model_name)
        self.waiting_for_room.labels(model_name)
        self.hand_backs.labels(model_name)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def finished(
        self,
        reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_s: float,
        ttft_s: float,
        gaps_s: list[float],
        ttft_slo_s: float | None = None,
        tbt_slo_s: float | None = None,
    ) -> None:
        """A finished request; its SLO outcome against its own targets, else the server's defaults."""
        self.success.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(generation_tokens)
        self.e2e.labels(self.model).observe(e2e_s)
        self.slo.labels(
            self.model, slo_outcome(ttft_s, gaps_s, ttft_slo_s or self.ttft_slo_s, tbt_slo_s or self.tbt_slo_s)
        ).inc()


def p90(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def slo_outcome(ttft_s: float, gaps_s: list[float], ttft_slo_s: float, tbt_slo_s: float) -> str:
    """attained when TTFT ≤ its target and the 90th percentile of the inter-token gaps ≤ the TBT target."""
    if ttft_s > ttft_slo_s:
        return "ttft_violated"
    if p90(gaps_s) > tbt_slo_s:
        return "tbt_violated"
    return "attained"


class WorkerMetrics:
    def __init__(self, worker_id: str, roles: str, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.labels = {"worker_id": worker_id, "roles": roles}
        self._gauges: list[tuple[Gauge, Callable[[], float]]] = []
        w = ["worker_id", "roles"]
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Time a request waited in this worker's queue.",
            w + ["stage"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.stage_time = {
            stage: Histogram(
                P + f"{stage}_time_seconds",
                f"Time a request spent in the {stage} stage here, "
                "from its first scheduled step to the end of the stage.",
                w,
                buckets=E2E_BUCKETS if stage == "decode" else TTFT_BUCKETS,
                registry=r,
            )
            for stage in ("encode", "prefill", "decode")
        }
        self.transfer_bytes = Counter(
            P + "transfer_bytes", "Page bytes pulled into this worker.", w + ["backend", "kind"], registry=r
        )
        self.transfer_seconds = Histogram(
            P + "transfer_seconds",
            "Time of one page pull into this worker.",
            w + ["backend", "kind"],
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.transfer_failures = Counter(
            P + "transfer_failures", "Page pulls into this worker that failed.", w + ["backend", "kind"], registry=r
        )
        self.leases_expired = Counter(
            P + "leases_expired", "Page leases freed because nobody acked them.", w, registry=r
        )
        self.iteration = Histogram(
            P + "iteration_time_seconds", "Time of one engine iteration.", w, buckets=ITL_BUCKETS, registry=r
        )

    def gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        preemptions: Callable[[], int] = lambda: 0,
        prefix_cache: Callable[[], tuple[int, int, int]] | None = None,
    ) -> None:
        """Gauges (and the engine's own counters) read at scrape time. `prefix_cache`: (prompt tokens queried,
        tokens found cached, requests whose images were not encoded because their KV was cached)."""
        if prefix_cache is not None:
            for i, (name, doc) in enumerate(
                (
                    ("prefix_cache_queries", "Prompt tokens admitted here with prefix caching on (vLLM's name)."),
                    ("prefix_cache_hits", "Of those, tokens whose KV was in the prefix cache (vLLM's name)."),
                    (
                        "image_encodes_skipped",
                        "Requests whose images' KV was in the prefix cache: no vision tower run.",
                    ),
                )
            ):
                self.registry.register(_CounterAtScrape(P + name, doc, self.labels, lambda i=i: prefix_cache()[i]))
        for name, doc, fn in (
            ("num_requests_running", "Requests running in this worker's engine.", running),
            ("num_requests_waiting", "Requests waiting in this worker's queues.", waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", kv_usage),
        ):
            gauge = Gauge(P + name, doc, list(self.labels), registry=self.registry)
            gauge.labels(**self.labels).set_function(fn)
            self._gauges.append((gauge, fn))
        self.registry.register(
            _CounterAtScrape(
                P + "num_preemptions",
                "Running requests whose KV blocks were freed for others (recomputed here, or handed back).",
                self.labels,
                preemptions,
            )
        )

    def relabel(self, roles: str) -> None:
        """The worker's roles changed (`Worker.SwitchRoles`): what it records from now on carries the new `roles`
        label. The old label's histograms and counters stay as they ended; its gauges, and the engine's counters
        read at scrape time, move to the new label (with their totals)."""
        old = dict(self.labels)
        self.labels["roles"] = roles  # the counters read at scrape time hold this very dict
        for gauge, fn in self._gauges:
            gauge.remove(*old.values())
            gauge.labels(**self.labels).set_function(fn)

    def stage(self, stage: str, queue_s: float | None, execute_s: float | None) -> None:
        if queue_s is not None:
            self.queue_time.labels(**self.labels, stage=stage).observe(queue_s)
        if execute_s is not None:
            self.stage_time[stage].labels(**self.labels).observe(execute_s)

    def transfer(self, backend: str, kind: str, num_bytes: int, seconds: float | None) -> None:
        if seconds is None:
            self.transfer_failures.labels(**self.labels, backend=backend, kind=kind).inc()
            return
        self.transfer_bytes.labels(**self.labels, backend=backend, kind=kind).inc(num_bytes)
        self.transfer_seconds.labels(**self.labels, backend=backend, kind=kind).observe(seconds)


class _CounterAtScrape:
    """A counter kept elsewhere (by the engine), read when scraped."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], read: Callable[[], int]):
        self.name, self.doc, self.labels, self.read = name, doc, labels, read

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), self.read())
        yield family
