"""The README's promise: the embedded default (configs/local.yaml: two SmolLM2 replicas behind the
gateway) gives sensible answers to the official `openai` client, streaming and not."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.servers import REPO_ROOT, free_port, run_process

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def embedded_default(tmp_path_factory):
    """configs/local.yaml exactly as shipped, but on free ports so a running `kvgate up` (or
    anything else on its ports) does not collide with the test."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "local.yaml").read_text())
    assert [r["launch"]["model"] for r in config["replicas"]] == ["smollm2", "smollm2"]
    config["gateway"]["port"] = free_port()
    for replica in config["replicas"]:
        replica["url"] = f"http://127.0.0.1:{free_port()}"
        if replica.get("kv_events"):
            replica["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                    "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    folder = tmp_path_factory.mktemp("quickstart")
    config["logging"]["file"] = str(folder / "kvgate-requests.jsonl")  # not into the checkout
    path = folder / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    port = config["gateway"]["port"]
    argv = [sys.executable, "-m", "gateway.cli", "up", "--config", str(path)]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="kvgate-up",
                     startup_timeout_s=240) as gateway:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
        client.gateway_url = gateway.url
        yield client


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answer_is_sensible(embedded_default):
    reply = embedded_default.chat.completions.create(model="smollm2", messages=QUESTION,
                                                     max_tokens=32, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_streamed_chat_answer_is_sensible(embedded_default):
    stream = embedded_default.chat.completions.create(model="smollm2", messages=QUESTION,
                                                      max_tokens=32, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text


def test_completion_answer_is_sensible(embedded_default):
    reply = embedded_default.completions.create(model="smollm2", prompt="The capital of France is",
                                                max_tokens=8, temperature=0)
    assert "Paris" in reply.choices[0].text


def test_the_readmes_python_example_verbatim(embedded_default):
    """The README's example as a newcomer pastes it (no max_tokens, default sampling), pointed at
    the test's port: it answers, quickly, with something."""
    readme = (REPO_ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "max_tokens" not in code and 'base_url="http://127.0.0.1:8000/v1"' in code
    code = code.replace("http://127.0.0.1:8000/v1", embedded_default.gateway_url + "/v1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


def test_default_sampling_is_the_model_cards_and_answers_paris(embedded_default):
    """No sampling fields: the replica's defaults (SmolLM2's model card: temperature 0.2, top_p 0.9,
    max_new_tokens 50) are what the request gets; a fixed seed makes the sample repeatable."""
    def ask(**fields):
        reply = embedded_default.chat.completions.create(model="smollm2", messages=QUESTION, seed=1, **fields)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    default_text, default_tokens = ask()
    assert "Paris" in default_text and default_tokens <= 50
    assert ask(temperature=0.2, top_p=0.9, max_tokens=50) == (default_text, default_tokens)
