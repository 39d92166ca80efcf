"""The README's promise: the embedded default (configs/local.yaml: two SmolLM2 replicas behind the
gateway) gives sensible answers to the official `openai` client, streaming and not."""
from __future__ import annotations

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
    path = tmp_path_factory.mktemp("quickstart") / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    port = config["gateway"]["port"]
    argv = [sys.executable, "-m", "gateway.cli", "up", "--config", str(path)]
    with run_process(argv, f"http://127.0.0.1:{port}/health", port=port, name="kvgate-up",
                     startup_timeout_s=240) as gateway:
        yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


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
