"""Greedy decoding of our LlamaForCausalLM + KVCache matches HF transformers token for token."""
from pathlib import Path

import pytest
import torch

from replica.loader import load_model
from replica.model import KVCache
from replica.tiny import build_checkpoint

transformers = pytest.importorskip("transformers")

torch.set_num_threads(2)
NEW_TOKENS = 32


def greedy_generate(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """Prefill the prompt, then decode one token at a time, always taking the argmax."""
    cache = KVCache(loaded.config, len(prompt_ids) + n, torch.float32)
    logits = loaded.model(torch.tensor(prompt_ids), cache)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = loaded.model(torch.tensor(out[-1:]), cache)
    return out


def hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def assert_same_greedy(loaded, hf_model, prompts: list[list[int]]) -> None:
    eos = set(loaded.tokenizer.stop_token_ids) | set(_as_list(hf_model.generation_config.eos_token_id))
    for prompt_ids in prompts:
        ours = greedy_generate(loaded, prompt_ids, NEW_TOKENS)
        theirs = hf_greedy(hf_model, prompt_ids, NEW_TOKENS)
        # transformers stops at eos; we decode through it, so compare up to where it stopped.
        assert ours[: len(theirs)] == theirs, f"prompt {prompt_ids[:8]}...: ours {ours} != hf {theirs}"
        assert len(theirs) == NEW_TOKENS or theirs[-1] in eos


def _as_list(value) -> list[int]:
    return [] if value is None else value if isinstance(value, list) else [value]


def hf_model_from_dir(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


TEXT_PROMPTS = [
    "The quick brown fox",
    "Hello, world! How are you today? I am",
    "def add(a, b):\n    return",
    "Once upon a time, in a small town by the sea, there lived a curious robot. Every morning it",
]


def test_tiny_matches_transformers():
    loaded = load_model("tiny")
    assert loaded.name == "tiny"
    prompts = [loaded.tokenizer.encode(text) for text in TEXT_PROMPTS]
    assert_same_greedy(loaded, hf_model_from_dir(loaded.source), prompts)


def test_gqa_tied_llama3_rope_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = build_checkpoint(tmp_path / "gqa", hidden_size=64, layers=2, heads=8, kv_heads=2, head_dim=16,
                            intermediate=96, rope_theta=500000.0, rope_scaling=scaling,
                            tie_word_embeddings=True, seed=1)
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings and loaded.config.rope_scaling["rope_type"] == "llama3"
    assert loaded.config.head_dim * loaded.config.num_attention_heads != loaded.config.hidden_size
    prompts = [loaded.tokenizer.encode(text) for text in TEXT_PROMPTS]
    # A prompt longer than original_max_position_embeddings exercises the scaled frequencies.
    prompts.append(loaded.tokenizer.encode(" ".join(TEXT_PROMPTS) * 2))
    assert_same_greedy(loaded, hf_model_from_dir(path), prompts)


def test_smollm2_gguf_matches_transformers():
    loaded = load_model("smollm2")
    assert (loaded.config.num_hidden_layers, loaded.config.num_attention_heads) == (30, 9)
    path = Path(loaded.source)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "Count from 1 to 10."]
    prompts = [loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in chats]
    prompts.append(loaded.tokenizer.encode("def fibonacci(n):\n"))
    assert_same_greedy(loaded, hf_model, prompts)


def test_prefill_in_chunks_equals_prefill_at_once():
    loaded = load_model("tiny")
    ids = torch.tensor(loaded.tokenizer.encode(TEXT_PROMPTS[3]))
    whole = KVCache(loaded.config, 64, torch.float32)
    expected = loaded.model(ids, whole, last_only=False)
    chunked = KVCache(loaded.config, 64, torch.float32)
    first = loaded.model(ids[:7], chunked, last_only=False)
    rest = loaded.model(ids[7:], chunked, last_only=False)
    assert chunked.length == whole.length == len(ids)
    torch.testing.assert_close(torch.cat([first, rest]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked.k[:, : len(ids)], whole.k[:, : len(ids)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["/nonexistent/model-dir", "not-a-model", __file__])
def test_load_model_rejects_bad_spec(spec):
    with pytest.raises(ValueError):
        load_model(spec)


def test_load_model_rejects_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        load_model(str(tmp_path))


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a = build_checkpoint(tmp_path / "a", seed=3)
    b = build_checkpoint(tmp_path / "b", seed=3)
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
