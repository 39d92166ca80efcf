"""How the embedded default answers the README's question at its sampling defaults.

One built-in SmolLM2 replica (what `kvgate up` serves), the README's chat question asked with N
fixed seeds three ways: the replica's defaults (the model card's temperature 0.2, top_p 0.9,
max_new_tokens 50: no sampling field sent), temperature 1.0 / top_p 1.0 (the replica's neutral
defaults before), and greedy. Prints how many answers mention Paris and the longest answer.

    .venv/bin/python -m bench.default_sampling            # 64 seeds, ~3 min
    .venv/bin/python -m bench.default_sampling --seeds 16

Ends with `figure paris_fraction_<sampling>: X` lines (the issue set no goal).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

from bench.chaos import free_port
from bench.pd import REPO_ROOT

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def ask(url: str, seed: int, fields: dict) -> tuple[str, int]:
    body = json.dumps({"messages": QUESTION, "seed": seed, **fields}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=64)
    args = parser.parse_args(argv)
    port = free_port()
    replica = subprocess.Popen([sys.executable, "-m", "replica", "--model", "smollm2", "--port", str(port),
                                "--threads", "2", "--log-format", "json"], cwd=REPO_ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if replica.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the SmolLM2 replica did not start")
                time.sleep(0.5)  # another process loading a model: poll, bounded
        rows = []
        for label, fields in (("replica defaults (model card)", {}),
                              ("temperature 1.0, top_p 1.0", {"temperature": 1.0, "top_p": 1.0, "max_tokens": 50}),
                              ("greedy", {"temperature": 0, "max_tokens": 50})):
            answers = [ask(url, seed, fields) for seed in range(args.seeds)]
            paris = sum("Paris" in text for text, _ in answers)
            rows.append((label, paris, max(tokens for _, tokens in answers)))
    finally:
        replica.terminate()
        replica.wait(30)
    print(f"{'sampling':<34}{'answers with Paris':>20}{'longest answer (tokens)':>26}")
    for label, paris, longest in rows:
        print(f"{label:<34}{f'{paris}/{args.seeds}':>20}{longest:>26}")
    for key, (_, paris, _) in zip(("defaults", "temperature_1", "greedy"), rows):
        print(f"figure paris_fraction_{key}: {paris / args.seeds:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
