"""Sampling: per-request parameters and the logits -> token choice (greedy, temperature, top-k, top-p).

Everything here is vectorised over the vocabulary (one sort at most per step); the functions take
[..., vocab] logits so the batched engine of the next step can reuse them unchanged. Semantics
follow vLLM: temperature defaults to 1.0 and 0 means greedy; top_k <= 0 / -1 and top_p == 1.0
disable those filters; a seeded request samples from its own torch.Generator so the same seed
gives the same tokens whatever else the engine runs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature a softmax over float32 logits is numerically greedy anyway.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def make_generator(self) -> torch.Generator | None:
        """A private RNG for seeded requests; None means 'use the engine's shared one'."""
        if self.seed is None:
            return None
        generator = torch.Generator(device="cpu")
        generator.manual_seed(self.seed & 0xFFFF_FFFF_FFFF_FFFF)
        return generator


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k largest logits along the last dim (ties at the k-th value kept), -inf the rest."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_value = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches top_p
    (always at least the most likely one), -inf the rest."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> int:
    """One token from 1-D float logits [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    scaled = apply_top_k(scaled, params.top_k)
    scaled = apply_top_p(scaled, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
