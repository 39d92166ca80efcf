"""Default sampling as vLLM derives it: a checkpoint's generation_config.json fills the fields a
request leaves out (`--generation-config auto|vllm|DIR`, `--override-generation-config`)."""
from __future__ import annotations

import json
import shutil

import pytest

from replica.generation_config import GenerationConfigError, SamplingDefaults, resolve_sampling_defaults
from tests.servers import run_replica
from tests.test_gateway import http

# What a Llama checkpoint's generation_config.json looks like (Llama-3.1-8B-Instruct's, plus a
# repetition_penalty and a max_new_tokens to show both paths).
LLAMA_STYLE = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
               "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1,
               "max_new_tokens": 5, "transformers_version": "4.45.0"}


@pytest.fixture
def checkpoint(tmp_path):
    from replica.tiny import tiny_checkpoint_dir
    path = tmp_path / "tiny-with-generation-config"
    shutil.copytree(tiny_checkpoint_dir(), path)
    (path / "generation_config.json").write_text(json.dumps(LLAMA_STYLE))
    return path


def test_a_checkpoints_generation_config_becomes_the_defaults(checkpoint):
    from replica.generation_config import read_generation_config
    recommended = read_generation_config(checkpoint)
    defaults, ignored = resolve_sampling_defaults("auto", recommended, None, "the checkpoint")
    # top_k 50 is transformers' own default: to_diff_dict (what vLLM reads) leaves it out.
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=-1, max_tokens=5, source="the checkpoint")
    assert ignored == {"repetition_penalty": 1.1}  # reported at start, not silently dropped
    assert resolve_sampling_defaults("vllm", recommended)[0] == SamplingDefaults()
    assert resolve_sampling_defaults(str(checkpoint), {})[0].temperature == 0.6


def test_override_sets_and_null_removes_fields():
    defaults, _ = resolve_sampling_defaults("auto", {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50},
                                            {"temperature": 0.7, "max_new_tokens": None})
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.7, 0.9, None)


@pytest.mark.parametrize("mode,override,match", [
    ("auto", {"temprature": 0.5}, "unknown generation config field"),
    ("auto", {"temperature": 9}, "temperature 9.0 is not in"),
    ("auto", {"top_p": 0}, "top_p 0.0 is not in"),
    ("/no/such/dir", None, "expected auto, vllm or a directory"),
])
def test_bad_generation_config_is_refused(mode, override, match):
    with pytest.raises(GenerationConfigError, match=match):
        resolve_sampling_defaults(mode, {}, override)


def test_replica_applies_the_checkpoints_defaults_to_fields_left_out(checkpoint):
    with run_replica(str(checkpoint)) as replica:
        status, _, info = http("GET", replica.url + "/model_info")
        assert info["preferred_sampling_params"] == {"temperature": 0.6, "top_p": 0.9, "top_k": -1, "max_tokens": 5}
        chat = {"messages": [{"role": "user", "content": "Tell me a story."}], "ignore_eos": True}
        status, _, answer = http("POST", replica.url + "/v1/chat/completions", chat)
        assert status == 200 and answer["usage"]["completion_tokens"] == 5   # max_new_tokens
        status, _, answer = http("POST", replica.url + "/v1/chat/completions", {**chat, "max_tokens": 9})
        assert answer["usage"]["completion_tokens"] == 9                     # the request's own wins
        logs = replica.logs()
        assert '"default_sampling"' in logs and '"default_sampling_ignored"' in logs and "repetition_penalty" in logs


def test_vllm_mode_and_override_flags(checkpoint):
    with run_replica(str(checkpoint), extra_args=["--generation-config", "vllm", "--override-generation-config",
                                                  '{"max_new_tokens": 3}']) as replica:
        status, _, info = http("GET", replica.url + "/model_info")
        assert info["preferred_sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 3}
