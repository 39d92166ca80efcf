"""/metrics of a gateway with several workers (`gateway.workers` > 1): one answer for all of them.

Each process (every worker, and the parent, which counts config reloads and replica restarts)
keeps its metrics in memory, as a single gateway does, and writes a snapshot of them to the run
directory once a second. Whichever worker answers /metrics merges its own live values with the
other processes' snapshots:
  counters, histograms  summed over the processes: rates and quantiles are the gateway's
  gauges                one series per worker, labelled `worker="N"` (in-flight requests, queue,
                        routing mode, replica state: what each worker sees; sum them in PromQL)
The others' part lags by up to a second. prometheus_client's multiprocess mode would be exact,
but it makes every update an mmap write (measured: a histogram observation 2.7 us instead of
1.1 us, and the gateway observes one per streamed token).

A restarted worker takes its predecessor's last snapshot as the base of its counters and
histograms, so the gateway's counters never go back (what the dead one counted in its last
second is lost, not counted twice)."""
from __future__ import annotations

import os
from pathlib import Path

import msgspec
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

log = structlog.get_logger("kvgate.workers")

_SUMMED = ("counter", "histogram", "summary")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()

# A family as stored: [name, type, documentation, unit, [[sample name, labels, value], ...]]
Family = list


def collect(registry: CollectorRegistry, counters_only: bool = False) -> list[Family]:
    out = []
    for metric in registry.collect():
        if counters_only and metric.type not in _SUMMED:
            continue
        out.append([metric.name, metric.type, metric.documentation, metric.unit,
                    [[s.name, s.labels, s.value] for s in metric.samples]])
    return out


def _summed_part(families: list[Family]) -> dict[tuple, float]:
    """(family, sample name, labels) -> value of the samples that add up across processes."""
    return {(name, sample, tuple(sorted(labels.items()))): value
            for name, typ, _doc, _unit, samples in families if typ in _SUMMED
            for sample, labels, value in samples if not sample.endswith("_created")}


class MetricsSnapshots:
    """This process's side: `write()` its snapshot (once a second and on the way out), `render()`
    the gateway's /metrics. `process` names it in the run directory and in gauges' `worker` label."""

    def __init__(self, run_dir: str | Path, process: str, registry: CollectorRegistry,
                 counters_only: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.process = process
        self.registry = registry
        self.counters_only = counters_only  # the parent's gauges mean nothing (it serves no requests)
        self.path = self.run_dir / f"metrics-{process}.msgpack"
        previous = _read(self.path)  # a predecessor's last snapshot: this worker was restarted
        self.base = _summed_part(previous) if previous else {}

    def families(self) -> list[Family]:
        """This process's metrics now, counters and histograms on top of the predecessor's."""
        families = collect(self.registry, self.counters_only)
        if self.base:
            unmatched = dict(self.base)
            for name, typ, _doc, _unit, samples in families:
                if typ in _SUMMED:
                    for sample in samples:
                        sample[2] += unmatched.pop((name, sample[0], tuple(sorted(sample[1].items()))), 0.0)
            by_name = {family[0]: family for family in families}
            for (name, sample, labels), value in unmatched.items():  # series this worker has not touched yet
                if name in by_name:
                    by_name[name][4].append([sample, dict(labels), value])
        return families

    def write(self) -> None:
        """Atomically (a reader never sees half a file); an error is logged, never raised."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_bytes(_encoder.encode(self.families()))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("metrics_snapshot_failed", path=str(self.path), error=str(exc))

    def render(self) -> bytes:
        parts = [(self.process, self.families())]
        for path in sorted(self.run_dir.glob("metrics-*.msgpack")):
            process = path.name[len("metrics-"):-len(".msgpack")]
            if process != self.process and (families := _read(path)):
                parts.append((process, families))
        return render_merged(parts)


def _read(path: Path) -> list[Family] | None:
    try:
        return _decoder.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def render_merged(parts: list[tuple[str, list[Family]]]) -> bytes:
    """Prometheus text for several processes' families (see the module docstring for the rules)."""
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, list]] = {}
    for process, families in parts:
        for name, typ, doc, unit, samples in families:
            metric = merged.get(name)
            if metric is None:
                metric = merged[name] = Metric(name, doc, typ, unit)
                sums[name] = {}
            if typ in _SUMMED:
                by_key = sums[name]
                for sample, labels, value in samples:
                    key = (sample, tuple(sorted(labels.items())))
                    entry = by_key.get(key)
                    if entry is None:
                        by_key[key] = [sample, labels, value]
                    elif sample.endswith("_created"):
                        entry[2] = min(entry[2], value)  # the series exists since the first process made it
                    else:
                        entry[2] += value
            else:
                for sample, labels, value in samples:
                    metric.add_sample(sample, {**labels, "worker": process}, value)
    for name, by_key in sums.items():
        for sample, labels, value in by_key.values():
            merged[name].add_sample(sample, labels, value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(merged.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self):
        return self.metrics
