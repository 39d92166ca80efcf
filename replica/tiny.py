"""Deterministic random Llama checkpoints for tests and the embedded default ("tiny").

The architecture and files are real (HF config.json, safetensors, a byte-level BPE tokenizer.json
trained offline on a built-in corpus, ChatML template); only the weights are random.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

BUILD_VERSION = 1  # bump when the files this module writes change
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A gateway routes each request to the replica whose
cache already holds the longest prefix of the prompt. Tokens are cut into blocks of sixteen, and
every block is hashed with its parent, so equal prefixes give equal hashes. When a replica fails,
the gateway retries the request on another one, or resumes a stream that was already in flight.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France, and Berlin is the capital of Germany. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"role": "user", "content": "Tell me a story about a robot who learns to paint."}
Once upon a time, in a small town by the sea, there lived a curious robot. Every morning it watched
the sunrise and wondered what colours were. One day it found a box of paints and began to learn.
The scheduler batches sequences together; prefill fills the cache and decode adds one token a step.
Attention looks back at every previous token; the key and value tensors are kept in memory.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, stra\u00dfe. \u4f60\u597d\uff0c\u4e16\u754c\u3002 \u3053\u3093\u306b\u3061\u306f\u3002 \U0001f600 \U0001f680 \u2764\ufe0f
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = _CORPUS.splitlines(keepends=True)
    tokenizer.train_from_iterator([lines * 4], trainer=trainer)
    return tokenizer


def _dump_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_checkpoint(
    out_dir,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 128,
    vocab_size: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rms_norm_eps: float = 1e-5,
    init_std: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write a random Llama checkpoint into out_dir. Same arguments give byte-identical files."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    actual_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    head_dim = head_dim or hidden_size // heads

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": actual_vocab, "hidden_size": hidden_size, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "initializer_range": init_std,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "torch_dtype": "float32",
    }
    _dump_json(out / "config.json", config)
    _dump_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
    })
    _dump_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "model_max_length": max_position_embeddings,
    })

    # Large std keeps the logits far apart: greedy decoding of random weights then has no near-ties,
    # so parity with other implementations is not at the mercy of float rounding.
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=init_std):
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": randn(actual_vocab, hidden_size, std=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1.0 + randn(hidden_size, std=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + randn(hidden_size, std=0.1)
        tensors[p + "self_attn.q_proj.weight"] = randn(q_size, hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = randn(kv_size, hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = randn(kv_size, hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = randn(hidden_size, q_size)
        tensors[p + "mlp.gate_proj.weight"] = randn(intermediate, hidden_size)
        tensors[p + "mlp.up_proj.weight"] = randn(intermediate, hidden_size)
        tensors[p + "mlp.down_proj.weight"] = randn(hidden_size, intermediate)
    tensors["model.norm.weight"] = 1.0 + randn(hidden_size, std=0.1)
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = randn(actual_vocab, hidden_size)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


DEFAULT_TINY = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=512, seed=0)


def tiny_checkpoint_dir() -> Path:
    """The default "tiny" checkpoint, built once per machine and cached by a fingerprint of its recipe."""
    fingerprint = hashlib.sha256(json.dumps([BUILD_VERSION, DEFAULT_TINY], sort_keys=True).encode()).hexdigest()[:12]
    root = Path(os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate")
    final = root / f"tiny-{fingerprint}"
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{fingerprint}-", dir=root))
    try:
        build_checkpoint(tmp, **DEFAULT_TINY)
        try:
            os.rename(tmp, final)  # atomic; loses the race harmlessly if another process got there first
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
