"""KV blocks as bytes: what a prefill replica sends and a decode replica writes into its cache.

Layout of n blocks: [layer][k, v][block][token in block][kv head][head dim] in the cache's dtype,
i.e. one contiguous run per layer and K/V (the runner's cache tensors are [num_blocks, block_size,
kv heads, head dim] per layer, so a block's tokens are already contiguous). Packing is one
index_select per layer and K/V into one preallocated buffer; unpacking one index_copy_ per layer
and K/V from a view of the received bytes (no intermediate copies). Buffers are numpy arrays, not
torch.empty or bytearray: numpy asks for huge pages on large allocations, so a fresh 100 MB buffer
costs ~10 ms of page faults instead of ~50 (bytearray also zeroes it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.kv_transfer import KVLayout


def layout_of(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
    k_cache = kv_caches[0][0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return KVLayout(num_layers=len(kv_caches), block_size=block_size, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, dtype=str(k_cache.dtype).removeprefix("torch."))


def pack_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> memoryview:
    """The blocks' bytes. Safe from any thread for pinned blocks (nobody writes them)."""
    if not block_ids:  # a release-only pull
        return memoryview(b"")
    k_cache = kv_caches[0][0]
    shape = (len(kv_caches), 2, len(block_ids)) + tuple(k_cache.shape[1:])
    raw = new_buffer(len(kv_caches) * 2 * len(block_ids) * k_cache[0].numel() * k_cache.element_size())
    out = torch.from_numpy(raw).view(k_cache.dtype).view(shape)
    index = torch.tensor(block_ids, dtype=torch.long)
    with torch.inference_mode():
        for layer, (k, v) in enumerate(kv_caches):
            torch.index_select(k, 0, index, out=out[layer, 0])
            torch.index_select(v, 0, index, out=out[layer, 1])
    return memoryview(raw)


def new_buffer(num_bytes: int) -> np.ndarray:
    """Uninitialised bytes for packed blocks (see the module docstring for why numpy)."""
    return np.empty(num_bytes, dtype=np.uint8)


@dataclass
class StagedKV:
    """Prompt blocks [first_block, first_block + num_blocks) pulled from a prefill replica, waiting
    in host memory for the engine to admit their request."""
    first_block: int
    num_blocks: int
    data: np.ndarray      # uint8, from new_buffer


def unpack_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], staged: StagedKV, skip_blocks: int,
                  block_ids: list[int]) -> None:
    """Write staged blocks [skip_blocks, skip_blocks + len(block_ids)) into cache blocks `block_ids`.
    The engine's worker calls this between forwards: the blocks are fresh allocations of the
    request being admitted, which no other sequence reads yet."""
    if not block_ids:
        return
    k_cache = kv_caches[0][0]
    shape = (len(kv_caches), 2, staged.num_blocks) + tuple(k_cache.shape[1:])
    blocks = torch.from_numpy(staged.data).view(k_cache.dtype).view(shape)
    index = torch.tensor(block_ids, dtype=torch.long)
    source = blocks[:, :, skip_blocks:skip_blocks + len(block_ids)]
    with torch.inference_mode():
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, index, source[layer, 0])
            v.index_copy_(0, index, source[layer, 1])
