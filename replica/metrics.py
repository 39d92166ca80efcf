"""The replica's Prometheus metrics under vLLM's names, so the gateway (and any vLLM dashboard)
reads kvgate replicas and vLLM servers the same way. One CollectorRegistry per server: tests
and embedded setups run several servers in one process without clashing."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets (seconds), so histograms from both line up.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
KV_TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                         30.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from replica.block_pool import BlockPool
    from replica.kv_pins import PinTable


class EngineStats(Protocol):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    pool: BlockPool
    pins: PinTable
    kv_staged_stale_total: int


class _EngineCollector:
    """Read at scrape time from the engine, which counts what it computed (including tokens of
    requests whose client left), so the numbers are the engine's work, not what was delivered."""

    def __init__(self, model_name: str, engine: EngineStats):
        self._model_name = model_name
        self._engine = engine

    def collect(self):
        label = [self._model_name]
        # vLLM publishes its KV capacity as labels of an info gauge; routers size their prefix
        # tables from it (gateway/scraper.py reads num_gpu_blocks).
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([str(self._engine.pool.block_size), str(self._engine.pool.num_blocks), "True"], 1.0)
        yield info
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the engine's running set.", self._engine.num_running),
                ("vllm:num_requests_waiting", "Requests queued, not yet running.", self._engine.num_waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
                 self._engine.kv_cache_usage)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        for name, doc, value in (
                ("vllm:prompt_tokens", "Prefilled prompt tokens.", self._engine.prompt_tokens_total),
                ("vllm:generation_tokens", "Generated tokens.", self._engine.generation_tokens_total),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 self._engine.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 self._engine.prefix_cache_hits),
                ("vllm:num_preemptions", "Sequences preempted (blocks freed, recomputed later).",
                 self._engine.num_preemptions)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        # Disaggregation (prefill side: pins held for pulls; decode side: pulled KV used too late).
        pins = self._engine.pins
        for name, doc, value in (
                ("kvgate:kv_pinned_requests", "Finished prefill requests whose KV blocks wait for a pull.", len(pins)),
                ("kvgate:kv_pinned_blocks", "KV blocks pinned for pulls.", pins.num_blocks)):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        for name, doc, value in (
                ("kvgate:kv_pins_pulled", "Pins released by a pull.", pins.claimed_total),
                ("kvgate:kv_pins_expired", "Pins released because their lease ran out (never pulled).",
                 pins.expired_total),
                ("kvgate:kv_staged_stale", "Pulled KV unused: the local prefix cache lost blocks the pull "
                                           "relied on before admission, so the prompt was computed here.",
                 self._engine.kv_staged_stale_total)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family


class ReplicaMetrics:
    def __init__(self, model_name: str, engine: EngineStats):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        r.register(_EngineCollector(model_name, engine))
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds",
                                             "Arrival to first generated token.", labels,
                                             buckets=TTFT_BUCKETS_S, registry=r).labels(model_name)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Time between consecutive generated tokens.", labels,
                                             buckets=ITL_BUCKETS_S, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram("vllm:e2e_request_latency_seconds",
                                             "Arrival to last token.", labels,
                                             buckets=E2E_BUCKETS_S, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._kv_bytes = Counter("kvgate:kv_transfer_bytes", "KV bytes moved by P/D pulls (received: decode "
                                 "side; sent: prefill side).", labels + ["direction"], registry=r)
        self._kv_blocks = Counter("kvgate:kv_transfer_blocks", "KV blocks moved by P/D pulls.",
                                  labels + ["direction"], registry=r)
        self._kv_seconds = Histogram("kvgate:kv_transfer_seconds", "Wall time of one KV pull (decode side).",
                                     labels, buckets=KV_TRANSFER_BUCKETS_S, registry=r).labels(model_name)
        self._kv_pulls = Counter("kvgate:kv_pulls", "Decode-leg KV pulls by result (ok, failed, recomputed).",
                                 labels + ["result"], registry=r)
        self._model_name = model_name

    def kv_transfer(self, direction: str, num_bytes: int, num_blocks: int, seconds: float | None = None) -> None:
        self._kv_bytes.labels(self._model_name, direction).inc(num_bytes)
        self._kv_blocks.labels(self._model_name, direction).inc(num_blocks)
        if seconds is not None:
            self._kv_seconds.observe(seconds)

    def kv_pull_result(self, result: str) -> None:
        self._kv_pulls.labels(self._model_name, result).inc()

    def request_success(self, finished_reason: str) -> None:
        self._success.labels(self._model_name, finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
