"""Serving-engine benchmark: batched decode throughput vs HF transformers, prefix-cache TTFT,
decode step time vs a memory-bandwidth roofline, resident memory under a burst.

    .venv/bin/python -m bench.engine [--model smollm2|tiny|DIR] [--threads 2] [--new-tokens 32]

Everything is measured in one run on the same model and prompts. The memory figure comes from a
real replica process (`python -m replica`), measured first, while it is the only process of the
run that maps torch (this one imports torch afterwards: pages of libtorch mapped by two processes
are shared, neither can drop them, and each one's RSS counts them); its peak RSS is the kernel's
high-water mark (VmHWM, reset once the replica is ready, so the load-time peak of weight
conversion is not counted).
Ends with `target <name>: <value> (goal <op> <n>) met|short` lines.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# torch, replica.engine, replica.loader: imported in the functions that use them, after the memory
# measurement (see the module docstring).


def target(name: str, value: float, op: str, goal: float, unit: str = "") -> None:
    met = value >= goal if op == ">=" else value <= goal
    print(f"target {name}: {value:.3g}{unit} (goal {op} {goal:g}{unit}) {'met' if met else 'short'}")


def measure_bandwidth_bytes_per_s(size_mb: int = 512, repeats: int = 5) -> float:
    """A large tensor copy: reads size + writes size bytes."""
    import torch

    src = torch.ones(size_mb * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


async def run_batch(engine, prompts: list[list[int]], max_tokens: int):
    """Submit all at once; returns (wall_s, tokens, per-request list of token arrival times)."""
    from replica.sampler import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()

    async def one(prompt):
        times = []
        async for _ in engine.submit(prompt, greedy):
            times.append(time.perf_counter())
        return times

    results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start, sum(len(r) for r in results), results, start


def hf_tokens_per_s(loaded, prompts: list[list[int]], new_tokens: int) -> float:
    import torch
    import transformers

    source = Path(loaded.source)
    if source.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                               dtype=torch.float32).eval()
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    start = time.perf_counter()
    produced = 0
    with torch.no_grad():
        for prompt in prompts:  # one at a time, as a plain HF server would
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            produced += out.shape[1] - len(prompt)
    del hf
    return produced / (time.perf_counter() - start)


def _proc_bytes(pid: int, field: str, file: str = "status") -> int:
    """A `Field:  N kB` line of /proc/PID/status (or smaps_rollup, for Pss: shared pages split
    among the processes mapping them), in bytes."""
    text = Path(f"/proc/{pid}/{file}").read_text()
    return int(next(line for line in text.splitlines() if line.startswith(field + ":")).split()[1]) * 1024


def replica_memory(model: str, kv_cache_gb: float, burst: int = 64, prompt_len: int = 64,
                   new_tokens: int = 16) -> dict:
    """Start a replica, send `burst` concurrent requests of random token IDs; its RSS once ready,
    its peak RSS during the burst, where the memory is after it, and what it says it holds."""
    import threading

    import httpx2 as httpx

    from tests.servers import run_replica

    rng = random.Random(7)
    with run_replica(model, threads=1, extra_args=["--kv-cache-gb", str(kv_cache_gb)],
                     startup_timeout_s=300) as replica:
        info = httpx.get(replica.url + "/server_info", timeout=30).json()
        vocab = info["vocab_size"]
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(burst)]

        def one(prompt):
            r = httpx.post(replica.url + "/v1/completions", timeout=600,
                           json={"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
            return r.status_code

        pid = replica.proc.pid
        time.sleep(1.0)  # the replica releases its start-up pages right after its ready line
        idle = _proc_bytes(pid, "VmRSS")
        try:  # 5 -> clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            exact = True
        except OSError:
            exact = False
        sampled = [idle]
        done = threading.Event()

        def sample():  # fallback where VmHWM cannot be reset: RSS every 20 ms
            while not done.wait(0.02):
                sampled[0] = max(sampled[0], _proc_bytes(pid, "VmRSS"))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with ThreadPoolExecutor(burst) as pool:
                codes = list(pool.map(one, prompts))
        finally:
            done.set()
            sampler.join()
        peak = _proc_bytes(pid, "VmHWM") if exact else sampled[0]
        return {"idle": idle, "peak": peak, "peak_source": "VmHWM" if exact else "sampled every 20 ms",
                "anon": _proc_bytes(pid, "RssAnon"), "file": _proc_bytes(pid, "RssFile"),
                "pss": _proc_bytes(pid, "Pss", "smaps_rollup"), "ok": f"{codes.count(200)}/{burst} ok",
                "weight_bytes": info["weight_bytes"], "kv_cache_bytes": info["kv_cache_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    memory = replica_memory(args.model, args.kv_cache_gb)  # first: see the module docstring

    import torch

    from replica.engine import Engine
    from replica.loader import load_model

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    print(f"model {loaded.name} ({loaded.source}), load {time.perf_counter() - t0:.1f}s, threads {args.threads}")
    vocab = loaded.config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(16, 48))] for _ in range(16)]
    engine = Engine(loaded.model, loaded.config, loaded.tokenizer, max_model_len=loaded.max_model_len,
                    kv_cache_gb=args.kv_cache_gb, max_num_batched_tokens=512)
    engine.start()
    bandwidth = measure_bandwidth_bytes_per_s()
    print(f"memory bandwidth (torch copy, read+write): {bandwidth / 1e9:.1f} GB/s")
    try:
        asyncio.run(run_batch(engine, prompts[:2], 4))  # warm-up
        throughput = {}
        for concurrency in (1, 4, 16):
            wall, tokens, _, _ = asyncio.run(run_batch(engine, prompts[:concurrency], args.new_tokens))
            throughput[concurrency] = tokens / wall
            print(f"engine  concurrency {concurrency:2d}: {tokens} tokens in {wall:.2f}s = "
                  f"{throughput[concurrency]:.1f} tok/s")

        # TTFT: a 2,000-token prompt cold, then another whose first 1,800 tokens are cached.
        long_prompt = [rng.randrange(100, vocab) for _ in range(2000)]
        cold_prompt = [rng.randrange(100, vocab) for _ in range(2000)]
        _, _, cold_times, cold_start = asyncio.run(run_batch(engine, [cold_prompt], 1))
        ttft_cold = cold_times[0][0] - cold_start
        asyncio.run(run_batch(engine, [long_prompt[:1800]], 1))  # puts 112 full blocks in the cache
        hits_before = engine.prefix_cache_hits
        _, _, warm_times, warm_start = asyncio.run(run_batch(engine, [long_prompt], 1))
        ttft_warm = warm_times[0][0] - warm_start
        print(f"TTFT 2000-token prompt: uncached {ttft_cold * 1000:.0f} ms, "
              f"{engine.prefix_cache_hits - hits_before} tokens cached {ttft_warm * 1000:.0f} ms")

        # Decode step time at batch 1 vs roofline (weights + KV read once per step).
        steps = 64
        _, _, times, _ = asyncio.run(run_batch(engine, [prompts[0]], steps + 1))
        step_s = (times[0][-1] - times[0][0]) / steps
        weight_bytes = engine.weight_bytes
        cfg = loaded.config
        mean_context = len(prompts[0]) + steps // 2
        kv_bytes = 2 * cfg.num_hidden_layers * mean_context * cfg.num_key_value_heads * cfg.head_dim * 4
        roofline_s = (weight_bytes + kv_bytes) / bandwidth
        print(f"decode step batch 1: {step_s * 1000:.2f} ms; roofline {roofline_s * 1000:.2f} ms "
              f"({(weight_bytes + kv_bytes) / 1e6:.0f} MB / {bandwidth / 1e9:.1f} GB/s); "
              f"fraction of roofline reached: {roofline_s / step_s:.2f}")
    finally:
        engine.shutdown()

    hf_tps = None
    if not args.skip_hf:
        hf_tps = hf_tokens_per_s(loaded, prompts, args.new_tokens)
        print(f"HF transformers generate, one at a time: {hf_tps:.1f} tok/s")
        for concurrency in (1, 4, 16):
            print(f"  engine/HF at concurrency {concurrency}: {throughput[concurrency] / hf_tps:.2f}x")

    kv_budget = args.kv_cache_gb * (1 << 30)
    allowed = kv_budget + memory["weight_bytes"] + 300e6
    print(f"replica (alone on the machine's torch pages), burst of 64 ({memory['ok']}): RSS idle "
          f"{memory['idle'] / 1e6:.0f} MB, peak {memory['peak'] / 1e6:.0f} MB ({memory['peak_source']}); "
          f"KV budget {kv_budget / 1e6:.0f} MB (allocated {memory['kv_cache_bytes'] / 1e6:.0f} MB) "
          f"+ model {memory['weight_bytes'] / 1e6:.0f} MB + 300 MB = {allowed / 1e6:.0f} MB")
    print(f"replica resident after the burst: {memory['anon'] / 1e6:.0f} MB private (RssAnon) + "
          f"{memory['file'] / 1e6:.0f} MB file-backed (RssFile: shared libraries); PSS {memory['pss'] / 1e6:.0f} MB")
    peak = memory["peak"]

    if hf_tps is not None:
        target("decode_speedup_16", throughput[16] / hf_tps, ">=", 5, "x")
    target("cached_ttft_ratio", ttft_warm / ttft_cold, "<=", 0.2, "x")
    target("burst_rss_mb", peak / 1e6, "<=", round(allowed / 1e6), " MB")
    print(f"roofline_fraction_batch1: {roofline_s / step_s:.2f}")


if __name__ == "__main__":
    main()
