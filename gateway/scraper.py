"""Load signals from the replicas themselves: each ready replica's /metrics, every
`routing.scrape_interval_s`, parsed with routing.load.parse_load_metrics and fed to the load
tracker (DESIGN contract 3). A failed scrape is logged once per failure streak and counted;
the tracker's staleness bound then ignores the old numbers. Never fatal."""
from __future__ import annotations

import asyncio
import re

import aiohttp
import structlog

from gateway.background import BackgroundLoop
from gateway.router import Router
from gateway.upstream import ReplicaPool, ReplicaState
from observability.metrics import GatewayMetrics
from routing.load import parse_load_metrics

log = structlog.get_logger("kvgate.scraper")

# vLLM exports its KV capacity as a label of an info gauge: vllm:cache_config_info{num_gpu_blocks="N",...}
_NUM_BLOCKS = re.compile(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', re.MULTILINE)
_OFF_LOOP_BYTES = 64 * 1024  # a big vLLM /metrics page takes ~10 ms to parse: do that in a thread


class Scraper(BackgroundLoop):
    task_name = "scraper"

    def __init__(self, pool: ReplicaPool, router: Router, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self._failing: set[str] = set()

    async def _run(self) -> None:
        while True:
            routing = self.router.config.routing
            replicas = [replica for replica in self.pool.replicas if replica.healthy]
            await asyncio.gather(*(self.scrape(replica, routing.scrape_timeout_s) for replica in replicas))
            await asyncio.sleep(routing.scrape_interval_s)  # a timer, not a wait on an event

    async def scrape(self, replica: ReplicaState, timeout_s: float) -> None:
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
            state.tracker.on_scrape(replica.name, scraped, state.clock())
        if match := _NUM_BLOCKS.search(text):
            self.router.learn_capacity(replica.name, int(match.group(1)))
