"""Load signals from the replicas themselves: each ready replica's /metrics, every
`routing.scrape_interval_s`, parsed with routing.load.parse_load_metrics and fed to the load
tracker (DESIGN contract 3). A failed scrape is logged once per failure streak and counted;
the tracker's staleness bound then ignores the old numbers. Never fatal.

With several workers (`gateway.workers` > 1) each one counts only the requests it routed itself;
the others' come over the bus (gateway/worker_bus.py: each worker's in-flight per replica,
within 20 ms of a change). A scrape alone would count them too, as traffic "from elsewhere",
but as of the last scrape (up to scrape_interval_s old): long enough for every worker to send
its next requests to the replica that looked idle then. So with peers the tracker gets a merged report:
the replica's own numbers minus what all workers had there at scrape time (traffic from outside
this gateway: other hosts, direct clients), plus what the other workers have there now."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Callable

import aiohttp
import structlog

from gateway.background import BackgroundLoop
from gateway.router import Router
from gateway.upstream import ReplicaPool, ReplicaState
from observability.metrics import GatewayMetrics
from routing.load import ScrapedLoad, parse_load_metrics

log = structlog.get_logger("kvgate.scraper")

# vLLM exports its KV capacity as a label of an info gauge: vllm:cache_config_info{num_gpu_blocks="N",...}
_NUM_BLOCKS = re.compile(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', re.MULTILINE)
_OFF_LOOP_BYTES = 64 * 1024  # a big vLLM /metrics page takes ~10 ms to parse: do that in a thread


@dataclass
class _Outside:
    """What a replica ran beyond this gateway's requests at its last scrape (with peers)."""
    at_s: float
    waiting: float
    in_flight: float
    kv_cache_usage: float | None


class Scraper(BackgroundLoop):
    task_name = "scraper"

    def __init__(self, pool: ReplicaPool, router: Router, metrics: GatewayMetrics,
                 peers: Callable[[str], tuple[int, int]] | None = None) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        # Other workers' (waiting, in flight) on a replica, or None for a one-process gateway.
        self.peers = peers
        self._outside: dict[str, _Outside] = {}
        self._failing: set[str] = set()

    async def _run(self) -> None:
        while True:
            routing = self.router.config.routing
            replicas = [replica for replica in self.pool.replicas if replica.healthy]
            await asyncio.gather(*(self.scrape(replica, routing.scrape_timeout_s) for replica in replicas))
            await asyncio.sleep(routing.scrape_interval_s)  # a timer, not a wait on an event

    async def scrape(self, replica: ReplicaState, timeout_s: float) -> None:
        window = self.router.state.tracker.scrape_window(replica.name)
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.pool.session.get(replica.base_url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/metrics answered HTTP {resp.status}")
                text = (await resp.read()).decode("utf-8", "replace")
            if len(text) > _OFF_LOOP_BYTES:
                scraped = await asyncio.get_running_loop().run_in_executor(None, parse_load_metrics, text)
            else:
                scraped = parse_load_metrics(text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.scrape_failures.labels(replica=replica.name).inc()
            if replica.name not in self._failing:
                self._failing.add(replica.name)
                log.warning("scrape_failed", replica=replica.name, error=f"{type(exc).__name__}: {exc}")
            return
        if replica.name in self._failing:
            self._failing.discard(replica.name)
            log.info("scrape_recovered", replica=replica.name)
        state = self.router.state
        if replica.name in state.model_of:  # not removed by a reload meanwhile
            if self.peers is None:
                state.tracker.on_scrape(replica.name, scraped, state.clock(), window)
            else:
                self._scraped_with_peers(replica.name, scraped, state.clock(), window)
        if match := _NUM_BLOCKS.search(text):
            self.router.learn_capacity(replica.name, int(match.group(1)))

    # ---- several workers ------------------------------------------------------------------------

    def _scraped_with_peers(self, replica: str, scraped: ScrapedLoad, now: float, window=None) -> None:
        own_waiting, own_in_flight = self.router.state.tracker.own_during(replica, window)
        peer_waiting, peer_in_flight = self.peers(replica)
        in_flight = max(scraped.waiting + scraped.running - own_in_flight - peer_in_flight, 0.0)
        waiting = min(max(scraped.waiting - own_waiting - peer_waiting, 0.0), in_flight)
        self._outside[replica] = _Outside(now, waiting, in_flight, scraped.kv_cache_usage)
        self._merge(replica, now)

    def _merge(self, replica: str, now: float) -> None:
        """Hand the tracker, as a scrape taken now, the replica's load beyond this worker's own:
        the other workers' now plus outside traffic as of the last scrape (while that is fresh)."""
        state = self.router.state
        outside = self._outside.get(replica)
        if outside is not None and now - outside.at_s > state.tracker.model.stale_after_s:
            outside = None  # as a stale scrape: ignored
        own_waiting, own_in_flight = state.tracker.own_during(replica, None)
        peer_waiting, peer_in_flight = self.peers(replica)
        waiting = own_waiting + peer_waiting + (outside.waiting if outside else 0.0)
        in_flight = own_in_flight + peer_in_flight + (outside.in_flight if outside else 0.0)
        state.tracker.on_scrape(replica, ScrapedLoad(waiting=waiting, running=in_flight - waiting,
                                                     kv_cache_usage=outside.kv_cache_usage if outside else None),
                                now)

    def refresh(self) -> None:
        """Another worker's counts changed (gateway/worker_bus.py): merge them in now."""
        if self.peers is None:
            return
        state = self.router.state
        now = state.clock()
        for replica in state.model_of:
            self._merge(replica, now)
