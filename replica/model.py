"""Llama-family causal LM in plain torch: RMSNorm, RoPE (with llama3/linear scaling), grouped-query
attention over a paged KV cache, SwiGLU MLP, tied or untied embeddings.

One forward runs a whole engine step: the new tokens of every scheduled sequence, concatenated
(varlen), decode rows (one token each) first, then prefill chunks. `StepMetadata` (built by the
model runner) says where each token's K/V goes and which blocks each sequence reads.

Projections are fused (qkv, gate+up) so a decode step is 4 matmuls per layer: on CPU the per-op
overhead, not the FLOPs, dominates a small model's decode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvgate_kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class StepMetadata:
    """One step's varlen batch. Tokens [0, num_decode_tokens) are decode rows (one per sequence,
    attention via paged_decode_attention); the rest are prefill chunks (paged_prefill_attention)."""
    positions: torch.Tensor              # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor           # [T] int64, block_id * block_size + offset
    num_decode_tokens: int
    decode_block_tables: torch.Tensor    # [D, max_blocks] int32
    decode_context_lens: torch.Tensor    # [D] int32 (including the new token)
    prefill_block_tables: torch.Tensor   # [P, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32, offsets into the prefill rows
    prefill_context_lens: torch.Tensor   # [P] int32
    logits_indices: torch.Tensor | None  # [S] int64 rows whose logits are wanted; None = all


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        heads = int(d["num_attention_heads"])
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        params = d.get("rope_parameters")  # transformers>=5 folds theta and scaling into one dict
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
            rope_scaling = None if rope_type == "default" else {**rope_scaling, "rope_type": rope_type}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with the checkpoint's scaling applied (as transformers computes them)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers (normalise in fp32, then scale) so greedy outputs match bit for bit.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.scale = self.head_dim ** -0.5
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Parameter(torch.empty(q_size + 2 * kv_size, config.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(config.hidden_size, q_size))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.hidden_size, config.intermediate_size))

    def forward(self, x, cos, sin, k_cache, v_cache, meta: StepMetadata) -> torch.Tensor:
        T = x.shape[0]
        h = self.input_layernorm(x)
        q, k, v = F.linear(h, self.qkv_proj).split(self.split_sizes, dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v.view(T, self.n_kv_heads, self.head_dim))
        d = meta.num_decode_tokens
        parts = []
        if d:
            parts.append(paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, self.scale))
        if d < T:
            parts.append(paged_prefill_attention(q[d:], k_cache, v_cache, meta.prefill_block_tables,
                                                 meta.prefill_query_start_loc, meta.prefill_context_lens,
                                                 self.scale))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = x + F.linear(attn.reshape(T, -1), self.o_proj)
        gate, up = F.linear(self.post_attention_layernorm(x), self.gate_up_proj).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self._inv_freq = rope_inv_freq(config)
        self._cos = self._sin = None  # [positions, 1, head_dim], grown on demand

    def _rope_tables(self, end: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < end or self._cos.dtype != dtype or self._cos.device != device:
            size = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            positions = torch.arange(size, dtype=torch.float32)
            freqs = positions[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos().to(device=device, dtype=dtype)[:, None, :]
            self._sin = emb.sin().to(device=device, dtype=dtype)[:, None, :]
        return self._cos, self._sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.LongTensor, meta: StepMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Float32 logits [S, vocab] for the rows in meta.logits_indices (all rows if None)."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self._rope_tables(int(meta.positions.max()) + 1, x.dtype, x.device)
        cos, sin = cos[meta.positions], sin[meta.positions]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        if meta.logits_indices is not None:
            x = x[meta.logits_indices]
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(self.norm(x), head).float()
