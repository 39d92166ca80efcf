"""The gateway's Prometheus metrics, in their own registry so tests and embedders can run several."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

# LLM latencies span decades: ms-scale token gaps, seconds-to-minutes for whole requests.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                  3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0,
                 60.0, 90.0, 120.0, 240.0, 480.0, 960.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_requests", "Requests answered, by replica and HTTP status.",
                                ["replica", "status"], registry=r)
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "Time to first token (streams).",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("kvgate_inter_token_latency_seconds", "Gap between streamed token events.",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvgate_e2e_request_latency_seconds", "Request latency, arrival to last byte.",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.in_flight = Gauge("kvgate_requests_in_flight", "Requests being proxied, by replica.",
                               ["replica"], registry=r)
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

    def observe_request(self, *, replica: str | None, status: int, ttft_s: float | None,
                        itl_s: list[float], e2e_s: float, prompt_tokens: int | None,
                        completion_tokens: int | None) -> None:
        self.requests.labels(replica=replica or "none", status=str(status)).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for gap in itl_s:
            self.itl.observe(gap)
        self.e2e.observe(e2e_s)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
