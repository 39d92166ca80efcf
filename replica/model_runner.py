"""The model runner: owns the paged K/V tensors and turns one scheduled step into one forward.

The scheduler hands over, per sequence, the token IDs to compute this step, where they start,
the sequence's block table and whether it samples. The runner orders rows decode-first, builds
the varlen metadata (positions, slot mapping, block tables) and returns one logits row per
sampling sequence. Per-step tensor building is O(tokens + blocks) of Python list work; the
forward itself dominates for any real model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.model import LlamaConfig, LlamaForCausalLM, StepMetadata

DEFAULT_BLOCK_SIZE = 16


@dataclass
class StepItem:
    token_ids: list[int]      # the new tokens of this sequence this step
    start_pos: int            # tokens already in the cache before them
    block_ids: list[int]      # the sequence's block table (covers start_pos + len(token_ids))
    sample: bool              # want logits for the last of these tokens


def kv_bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def num_blocks_for_budget(config: LlamaConfig, block_size: int, dtype: torch.dtype, kv_cache_gb: float) -> int:
    return int(kv_cache_gb * (1 << 30)) // kv_bytes_per_block(config, block_size, dtype)


def fit_context(max_model_len: int, num_blocks: int, block_size: int, *, requested: bool,
                block_bytes: int) -> int:
    """The context the replica serves. One sequence must fit the KV cache, else it could never
    finish (vLLM checks the same at start). A model context larger than the cache is capped to the
    cache (the caller logs it); a `--max-model-len` the user set that does not fit is refused with
    both numbers, as vLLM refuses to start."""
    cache_tokens = num_blocks * block_size
    if max_model_len <= cache_tokens:
        return max_model_len
    if not requested:
        return cache_tokens
    needed_blocks = -(-max_model_len // block_size)
    needed_gb = needed_blocks * block_bytes / (1 << 30) * 1.0001  # printed rounded: never short of it
    raise ValueError(
        f"--max-model-len {max_model_len} needs {needed_blocks} KV cache blocks for one sequence, but "
        f"the KV cache holds {num_blocks} blocks ({cache_tokens} tokens). Raise --kv-cache-gb to at least "
        f"{needed_gb:.4g} or lower --max-model-len to at most {cache_tokens}.")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: LlamaConfig, num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype | None = None):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype or next(model.parameters()).dtype
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # zeros, not empty: padded table entries are read (then masked) and NaN * 0 would be NaN.
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                          for _ in range(config.num_hidden_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    @torch.inference_mode()
    def execute(self, items: list[StepItem], all_logits: bool = False) -> torch.Tensor:
        """Logits [number of sampling items, vocab] in the order of `items` (or, with all_logits,
        one row per token in decode-first row order, for tests)."""
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) != 1)
        decodes = [items[i] for i in order if len(items[i].token_ids) == 1]
        prefills = [items[i] for i in order if len(items[i].token_ids) != 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_of_last: dict[int, int] = {}
        for i in order:
            item = items[i]
            input_ids.extend(item.token_ids)
            span = range(item.start_pos, item.start_pos + len(item.token_ids))
            positions.extend(span)
            table = item.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            row_of_last[i] = len(input_ids) - 1
        width = max(len(item.block_ids) for item in items)

        def tables(group: list[StepItem]) -> torch.Tensor:
            return torch.tensor([it.block_ids + [0] * (width - len(it.block_ids)) for it in group],
                                dtype=torch.int32).view(len(group), width)

        query_start = [0]
        for it in prefills:
            query_start.append(query_start[-1] + len(it.token_ids))
        logits_indices = None
        if not all_logits:
            logits_indices = torch.tensor([row_of_last[i] for i, it in enumerate(items) if it.sample],
                                          dtype=torch.long)
        meta = StepMetadata(
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode_tokens=len(decodes),
            decode_block_tables=tables(decodes),
            decode_context_lens=torch.tensor([it.start_pos + 1 for it in decodes], dtype=torch.int32),
            prefill_block_tables=tables(prefills),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            prefill_context_lens=torch.tensor([it.start_pos + len(it.token_ids) for it in prefills],
                                              dtype=torch.int32),
            logits_indices=logits_indices,
        )
        return self.model(torch.tensor(input_ids, dtype=torch.long), meta, self.kv_caches)


def greedy_generate(runner: ModelRunner, prompt_ids: list[int], max_new_tokens: int,
                    chunk_size: int | None = None) -> list[int]:
    """One sequence, greedy, through the paged path with blocks 0..n (tests and benchmarks).
    `chunk_size` prefills the prompt in chunks, as the scheduler does for long prompts."""
    bs = runner.block_size
    total = len(prompt_ids) + max_new_tokens
    block_ids = list(range(-(-total // bs)))
    if len(block_ids) > runner.num_blocks:
        raise ValueError(f"{total} tokens need {len(block_ids)} blocks; the pool has {runner.num_blocks}")
    chunk_size = chunk_size or len(prompt_ids)
    start = 0
    while start < len(prompt_ids):
        chunk = prompt_ids[start:start + chunk_size]
        logits = runner.execute([StepItem(chunk, start, block_ids, True)])
        start += len(chunk)
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = runner.execute([StepItem(out[-1:], start, block_ids, True)])
        start += 1
    return out
