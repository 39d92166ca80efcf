"""Greedy decoding of our LlamaForCausalLM through the paged path (model runner, block tables, paged
attention) matches HF transformers token for token."""
from pathlib import Path

import pytest
import torch

from replica.loader import load_model
from replica.model_runner import ModelRunner, StepItem, greedy_generate as paged_greedy
from replica.tiny import build_checkpoint

transformers = pytest.importorskip("transformers")

torch.set_num_threads(2)
NEW_TOKENS = 32


def greedy_generate(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """Prefill the prompt (in chunks of 13, crossing block edges), then decode one token at a time."""
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=-(-(len(prompt_ids) + n) // 16) + 1)
    return paged_greedy(runner, prompt_ids, n, chunk_size=13)


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
    chats = ["What is the capital of France?", "Write a Python function that reverses a string.", "Count from 1 to 10."]
    prompts = [loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": c}]))
               for c in chats]
    assert_same_greedy(loaded, hf_model, prompts)


def test_prefill_in_chunks_equals_prefill_at_once():
    loaded = load_model("tiny")
    ids = loaded.tokenizer.encode(TEXT_PROMPTS[3])
    # Scattered, out-of-order block tables: the paged path must not assume contiguous blocks.
    count = -(-len(ids) // 4)
    whole = ModelRunner(loaded.model, loaded.config, num_blocks=count, block_size=4)
    table = list(range(count))[::-1]
    expected = whole.execute([StepItem(ids, 0, table, True)], all_logits=True)
    chunked = ModelRunner(loaded.model, loaded.config, num_blocks=count, block_size=4)
    first = chunked.execute([StepItem(ids[:7], 0, table, True)], all_logits=True)
    rest = chunked.execute([StepItem(ids[7:], 7, table, True)], all_logits=True)
    torch.testing.assert_close(torch.cat([first, rest]), expected, rtol=1e-4, atol=1e-4)
    for (k_whole, _), (k_chunked, _) in zip(whole.kv_caches, chunked.kv_caches):
        torch.testing.assert_close(k_chunked[table], k_whole[table], rtol=1e-5, atol=1e-5)


def test_one_batched_step_equals_each_sequence_alone():
    """Decode rows and prefill chunks of different sequences in one forward give each sequence
    the logits it gets alone."""
    loaded = load_model("tiny")
    prompts = [loaded.tokenizer.encode(t) for t in TEXT_PROMPTS]
    alone = []
    for prompt in prompts:
        runner = ModelRunner(loaded.model, loaded.config, num_blocks=16, block_size=4)
        table = list(range(-(-len(prompt) // 4)))
        runner.execute([StepItem(prompt[:-1], 0, table, False)])
        alone.append(runner.execute([StepItem(prompt[-1:], len(prompt) - 1, table, True)])[0])
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=64, block_size=4)
    tables, next_block = [], 0
    for prompt in prompts:
        count = -(-len(prompt) // 4)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    # sequences 0 and 2 prefill everything but their last token first; 1 and 3 are fresh
    runner.execute([StepItem(prompts[i][:-1], 0, tables[i], False) for i in (0, 2)])
    items = [StepItem(prompts[1], 0, tables[1], True), StepItem(prompts[0][-1:], len(prompts[0]) - 1, tables[0], True),
             StepItem(prompts[3], 0, tables[3], True), StepItem(prompts[2][-1:], len(prompts[2]) - 1, tables[2], True)]
    batched = runner.execute(items)
    for row, index in enumerate((1, 0, 3, 2)):
        torch.testing.assert_close(batched[row], alone[index], rtol=1e-4, atol=1e-4)


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
