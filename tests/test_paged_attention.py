"""Paged attention references agree with plain dense causal attention."""
import torch

from kvgate_kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv


def dense_causal(q, k, v, scale):
    """q [Tq, H, D] at the end of k/v [L, KVH, D]: the textbook formula, no SDPA."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_len, k_len = q.shape[0], k.shape[0]
    mask = torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def scattered_cache(lengths, block_size=4, kv_heads=2, head_dim=8, num_blocks=64, seed=0):
    """K/V for several sequences written into shuffled blocks, plus the dense originals."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, dense = [], []
    max_blocks = max(-(-n // block_size) for n in lengths)
    for n in lengths:
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        k = torch.randn(n, kv_heads, head_dim, generator=g)
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        slots = torch.tensor([blocks[t // block_size] * block_size + t % block_size for t in range(n)])
        write_kv(k_cache, v_cache, slots, k, v)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        dense.append((k, v))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), dense


def test_decode_matches_dense_attention_for_mixed_lengths_and_gqa():
    lengths = [1, 5, 17, 33]
    k_cache, v_cache, tables, dense = scattered_cache(lengths)
    q = torch.randn(len(lengths), 4, 8)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), scale=0.35)
    for i, (k, v) in enumerate(dense):
        expected = dense_causal(q[i:i + 1], k, v, 0.35)[0]
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def test_prefill_after_cached_prefix_matches_dense_attention():
    lengths = [9, 20, 3]
    new_tokens = [4, 20, 1]   # seq 0: 5 cached + 4 new; seq 1: no cache; seq 2: 2 cached + 1 new
    k_cache, v_cache, tables, dense = scattered_cache(lengths)
    q = torch.randn(sum(new_tokens), 4, 8)
    starts = torch.tensor([0, 4, 24, 25])
    out = paged_prefill_attention(q, k_cache, v_cache, tables, starts, torch.tensor(lengths), scale=0.35)
    for i, (k, v) in enumerate(dense):
        s, e = starts[i], starts[i + 1]
        torch.testing.assert_close(out[s:e], dense_causal(q[s:e], k, v, 0.35), rtol=1e-5, atol=1e-5)
