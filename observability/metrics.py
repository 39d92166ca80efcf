"""The gateway's Prometheus metrics, in their own registry so tests and embedders can run several.

Per request the gateway touches a handful of labelled series; `labels()` validates and looks up
its arguments each time (~2.5 us), so the hot ones are looked up once per label set and kept
(`replica_counter`). A finished request's figures (count by replica and
status, TTFT, inter-token gaps, latency, tokens) and each try's per-replica amounts (`add`: cached
tokens predicted and reported) are added to plain Python totals under one lock,
and folded into the Prometheus series every FLUSH_EVERY requests and whenever the registry is
collected (a /metrics scrape, a worker's snapshot): ~15 locked updates per request become a few
per batch, and what a scrape reads is always complete. Requests in flight by replica are read
from the load tracker when collected (`in_flight.source`), with nothing to update per request."""
from __future__ import annotations

import threading
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily

# LLM latencies span decades: ms-scale token gaps, seconds-to-minutes for whole requests.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                  3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0,
                 60.0, 90.0, 120.0, 240.0, 480.0, 960.0)


FLUSH_EVERY = 256  # finished requests folded into the series at once (and at every collection)


class _FlushFirst:
    """Registered before every metric: collecting the registry folds the pending totals in first."""

    def __init__(self, metrics: "GatewayMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        if self.metrics.before_collect is not None:
            self.metrics.before_collect()  # the records still pending (RequestLog.flush_if_on_loop)
        self.metrics.flush()
        return []


class _ReadOnCollect:
    """A gauge by replica whose values a function gives when the registry is collected: `source`
    returns (replica, value) pairs (the gateway sets it to the load tracker's own in-flight
    counts; none until then)."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.source = lambda: ()

    def collect(self):
        family = GaugeMetricFamily(self.name, self.documentation, labels=["replica"])
        for replica, value in self.source():
            family.add_metric([replica], value)
        return [family]


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._lock = threading.Lock()
        self._reset_pending()
        self.before_collect = None  # called first at each collection (the gateway: its request log's flush)
        r.register(_FlushFirst(self))
        self.requests = Counter("kvgate_requests", "Requests answered, by replica and HTTP status.",
                                ["replica", "status"], registry=r)
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "Time to first token (streams).",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("kvgate_inter_token_latency_seconds", "Gap between streamed token events.",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvgate_e2e_request_latency_seconds", "Request latency, arrival to last byte.",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.in_flight = _ReadOnCollect("kvgate_requests_in_flight", "Requests being proxied, by replica.")
        r.register(self.in_flight)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("kvgate_generation_tokens",
                                         "Generated tokens of finished requests.", registry=r)
        # Routing: how the prefix table's predictions compare with what replicas report.
        self.predicted_cached_tokens = Counter(
            "kvgate_predicted_cached_tokens", "Prompt tokens the router expected cached where it sent them.",
            ["replica"], registry=r)
        self.reported_cached_tokens = Counter(
            "kvgate_reported_cached_tokens", "Prompt tokens replicas reported cached (usage.cached_tokens).",
            ["replica"], registry=r)
        self.routing_mode = Gauge("kvgate_routing_mode", "Per replica: 1 precise (KV events), 0 approximate.",
                                  ["replica"], registry=r)
        self.kv_events_fallbacks = Counter(
            "kvgate_kv_events_fallbacks", "Times a replica's KV events stopped and routing fell back to "
            "approximate mode.", ["replica", "reason"], registry=r)
        self.kv_events_resyncs = Counter("kvgate_kv_events_resyncs", "Gaps in a replica's KV event sequence "
                                         "resynchronised through its replay endpoint.", ["replica"], registry=r)
        self.kv_event_batches = Counter("kvgate_kv_event_batches", "KV event batches applied.", ["replica"],
                                        registry=r)
        self.prefill_rate = Gauge(
            "kvgate_replica_prefill_tokens_per_second", "Per replica: prompt tokens prefilled per second as "
            "observed (uncached tokens / routing to first token, of requests with nothing of ours queued "
            "ahead; moving average). Compare with routing.load.prefill_tokens_per_s.", ["replica"], registry=r)
        self.routing_prefill_rate = Gauge(
            "kvgate_routing_prefill_tokens_per_second", "Per model: the prefill rate routing's load model uses "
            "for its replicas, learned from their requests (routing.load.learn); absent until "
            "learned (then routing.load.prefill_tokens_per_s applies).", ["model"], registry=r)
        self.routing_decode_step = Gauge(
            "kvgate_routing_decode_step_seconds", "Per model: one decode step of a batch of one as routing's load "
            "model counts it, learned from its streams' token intervals (routing.load.learn); absent until learned "
            "(then routing.load.decode_step_base_s + decode_step_s_per_seq applies).", ["model"], registry=r)
        self.scrape_failures = Counter("kvgate_scrape_failures", "Failed /metrics scrapes of a replica.",
                                       ["replica"], registry=r)
        self.config_reloads = Counter("kvgate_config_reloads", "Routing YAML reloads, by result.", ["result"],
                                      registry=r)
        # Failover: what failed, what was tried again, how long a resumed stream waited.
        self.try_failures = Counter("kvgate_try_failures", "Tries that a replica failed (connect error, "
                                    "timeout, stall, 5xx, dropped stream).", ["replica"], registry=r)
        self.retries = Counter("kvgate_retries", "Tries after the first: retry (no token yet) or resume "
                               "(continued after k tokens).", ["kind"], registry=r)
        self.resume_latency = Histogram("kvgate_resume_latency_seconds", "A failed try to the next try's "
                                        "first token.", buckets=TTFT_BUCKETS_S, registry=r)
        self.queued = Gauge("kvgate_queued_requests", "Requests waiting for a replica with room.", registry=r)
        self.replica_state = Gauge("kvgate_replica_state", "1 for the state each replica is in "
                                   "(starting, healthy, ejected, probing, draining).", ["replica", "state"],
                                   registry=r)
        self.ejections = Counter("kvgate_replica_ejections", "Times a replica was taken out of rotation.",
                                 ["replica", "reason"], registry=r)
        self.panic_routed = Counter("kvgate_panic_routed_requests", "Requests sent to replicas out of rotation "
                                    "because none serving their model was in it (health.panic_routing).",
                                    ["model"], registry=r)
        # Prefill/decode pools.
        self.pd_requests = Counter("kvgate_pd_requests", "P/D tries by path: prefill_decode (two legs), "
                                   "skipped_prefill (the decode replica held the prompt), fallback (no "
                                   "prefill replica answered: the decode replica prefilled).", ["path"], registry=r)
        self.kv_transfer_bytes = Counter("kvgate_kv_transfer_bytes", "KV cache bytes decode replicas pulled "
                                         "from prefill replicas (as they reported).", registry=r)
        self.kv_transfer_seconds = Histogram("kvgate_kv_transfer_seconds", "KV pulls, as decode replicas "
                                             "reported them.", buckets=ITL_BUCKETS_S, registry=r)
        self.pool_in_flight = Gauge("kvgate_pool_in_flight", "The gateway's requests on each pool (prefill, "
                                    "decode, mixed): its queue depths.", ["pool"], registry=r)
        self.restarts = Counter("kvgate_replica_restarts", "Launched replicas restarted after they exited.",
                                ["replica"], registry=r)

        self._children: dict[tuple, object] = {}

    def _child(self, metric, *values: str):
        """metric.labels(*values), looked up once (series are never removed from these metrics)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def add(self, metric, replica: str, amount: float = 1, also=None, also_amount: float = 0) -> None:
        """metric.labels(replica).inc(amount), folded in with the next flush (a Gauge's amount may
        be negative): per request, a dict update instead of a locked prometheus_client update.
        `also`: a second metric of the same replica, added `also_amount` under the same lock."""
        key = (metric, replica)
        with self._lock:
            adds = self._adds
            adds[key] = adds.get(key, 0) + amount
            if also is not None:
                key = (also, replica)
                adds[key] = adds.get(key, 0) + also_amount
            self._pending_adds += 1
            full = self._pending_adds >= FLUSH_EVERY
        if full:
            self.flush()

    def replica_counter(self, metric, replica: str):
        return self._child(metric, replica)

    def observe_record(self, record) -> None:
        """A finished request (its RequestRecord) into the request metrics: observe_records."""
        self.observe_records((record,))

    def observe_records(self, records) -> None:
        """Finished requests (RequestRecords) into the request metrics, folded in with the next
        flush: their replicas and statuses, TTFTs, token intervals, end to end times and token
        counts. The request log hands over a loop turn's records at once (RequestLog.observe)."""
        now = None
        with self._lock:
            counts, ttft, itl, e2e = self._counts, self._ttft, self._itl, self._e2e
            prompt_total = completion_total = 0
            for record in records:
                started, first, finished = record.started_s, record.first_token_s, record.finished_s
                if finished is None:
                    finished = now = now or time.perf_counter()
                key = (record.replica or "none", record.status)
                counts[key] = counts.get(key, 0) + 1
                if first is not None:
                    ttft.append(first - started)
                if record.itl_s:
                    itl += record.itl_s
                e2e.append(finished - started)
                prompt_total += record.prompt_tokens or 0
                completion_total += record.completion_tokens or 0
            self._prompt_tokens += prompt_total
            self._completion_tokens += completion_total
            self._pending += len(records)
            full = self._pending >= FLUSH_EVERY
        if full:
            self.flush()

    def _reset_pending(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._e2e: list[float] = []
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._pending = 0
        self._adds: dict[tuple[object, str], float] = {}  # (metric, replica) -> amount (add)
        self._pending_adds = 0

    def flush(self) -> None:
        """Fold the finished requests' pending totals into the Prometheus series."""
        with self._lock:
            if not self._pending and not self._pending_adds:
                return
            counts, ttft, itl, e2e = self._counts, self._ttft, self._itl, self._e2e
            prompt_tokens, completion_tokens = self._prompt_tokens, self._completion_tokens
            adds = self._adds
            self._reset_pending()
        for (metric, replica), amount in adds.items():
            if amount:
                self._child(metric, replica).inc(amount)
            else:  # a gauge back where it was: its series still shows, at its value
                self._child(metric, replica)
        for (replica, status), count in counts.items():
            self._child(self.requests, replica, str(status)).inc(count)
        for histogram, values in ((self.ttft, ttft), (self.itl, itl), (self.e2e, e2e)):
            if values:
                observe_many(histogram, values)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """histogram.observe(v) for each value, with one update per bucket touched: a bisect per
    value, then each bucket's count and the sum incremented once (prometheus_client's Histogram
    keeps `_upper_bounds`, `_buckets` and `_sum`; without them, one observe per value)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 3:
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        index = bisect_left(bounds, value)  # the first bound >= value (the last one is +Inf)
        counts[index] = counts.get(index, 0) + 1
    for index, count in counts.items():
        buckets[index].inc(count)
    total.inc(sum(values))
