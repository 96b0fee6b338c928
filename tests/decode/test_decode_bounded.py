"""``BoundedDilatedKVCache`` (SPEC section 8): a cache bounded by the branches, whose outputs equal
the float64 reference of causal dilated attention over each whole sequence, token by token."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from common import make_inputs, one_thread  # noqa: F401  (one_thread: an autouse fixture)
from reference import reference_attention
from tolerance import assert_within_rule

from dilated_attention.decode import BoundedDilatedKVCache, DilatedKVCache
from dilated_attention.op import slots as _slots

# (Hq, Hkv, N, segment_lengths, dilation_rates)
SHAPES = [
    pytest.param(4, 4, 40, (8, 16, 32), (1, 2, 4), id="three-branches-ragged"),
    pytest.param(4, 2, 29, (6, 12), (1, 3), id="gqa-ragged"),
    pytest.param(8, 2, 37, (4, 8, 16), (1, 4, 8), id="gqa-r-above-group"),
    pytest.param(2, 1, 24, (8,), (4,), id="uncovered-rows"),  # r > Hq: some (p, h) read nothing
    pytest.param(2, 2, 20, (32, 4), (2, 1), id="w-greater-than-N"),
    # multi-query models (StarCoder: 48 heads, 1 kv head): more than 32 query heads per kv head
    pytest.param(48, 1, 21, (4, 8), (1, 2), id="multi-query-48"),
    pytest.param(64, 1, 19, (8, 16), (1, 4), id="multi-query-64"),
]


def decode_all(cache, qkv, chunks, layer=0, **kw):
    """Run ``cache`` over the chunks [(a, b)] of one layer's q, k, v; out and lse of every position."""
    q, k, v = qkv
    outs, lses = [], []
    for a, b in chunks:
        o, s = cache.attend(layer, q[:, a:b], k[:, a:b], v[:, a:b], return_lse=True, **kw)
        cache.advance(b - a)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 1), torch.cat(lses, -1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("Hq,Hkv,N,segs,rates", SHAPES)
def test_token_by_token_equals_reference_and_full_cache(Hq, Hkv, N, segs, rates, fused):
    """A prefill, then one token at a time: out and lse equal the reference of the whole causal
    sequence, and the full cache's decode gives the same outputs."""
    qkv = make_inputs(2, N, Hq, Hkv, 8, torch.float64, seed=1, requires_grad=False)
    ref, ref_lse = reference_attention(*qkv, segs, rates, is_causal=True)
    cache = BoundedDilatedKVCache(1, 2, Hq, Hkv, 8, segs, rates, dtype=torch.float64, fused=fused)
    P = 5
    out, lse = decode_all(cache, qkv, [(0, P)] + [(p, p + 1) for p in range(P, N)])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    full = DilatedKVCache(1, 2, N, Hkv, 8, dtype=torch.float64)
    outs = []
    for a, b in [(0, P)] + [(p, p + 1) for p in range(P, N)]:
        outs.append(full.attend(0, *(t[:, a:b] for t in qkv), segs, rates))
        full.advance(b - a)
    torch.testing.assert_close(out, torch.cat(outs, 1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("budget", [1, 1 << 24])
def test_chunked_prefill(monkeypatch, budget):
    """New tokens in chunks on a non-empty cache, across segment boundaries, split into score
    chunks (budget 1: one query at a time)."""
    monkeypatch.setattr(_slots, "_SCORE_BUDGET", budget)
    segs, rates = (8, 16), (1, 2)
    qkv = make_inputs(2, 30, 4, 2, 8, torch.float64, seed=3, requires_grad=False)
    ref, ref_lse = reference_attention(*qkv, segs, rates, is_causal=True)
    cache = BoundedDilatedKVCache(1, 2, 4, 2, 8, segs, rates, dtype=torch.float64)
    out, lse = decode_all(cache, qkv, [(0, 1), (1, 11), (11, 12), (12, 30)])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("first", ["prefill", "chunk"])
def test_left_padded_batch_of_different_lengths(first, fused):
    """Prompts of different lengths left-padded (``num_new``), padding filled with NaN, then
    decoded in lockstep: every row equals the reference of its own sequence; padding gives 0."""
    Hq, Hkv, segs, rates = 4, 2, (4, 8, 16), (1, 2, 4)
    lengths = [3, 11, 0]
    steps, T = 9, 11
    q, k, v = make_inputs(3, T + steps, Hq, Hkv, 8, torch.float64, seed=2, requires_grad=False)
    cache = BoundedDilatedKVCache(2, 3, Hq, Hkv, 8, segs, rates, dtype=torch.float64, fused=fused)
    if first == "chunk":  # one token of every row first, then the rest of the prompts left-padded
        cache.attend(1, q[:, :1], k[:, :1], v[:, :1])
        cache.attend(0, q[:, :1], k[:, :1], v[:, :1])
        cache.advance(1)
    done = cache.seqlens.tolist()
    rest = [max(0, n - d) for n, d in zip(lengths, done, strict=True)]
    pq, pk, pv = (torch.full((3, T, *t.shape[2:]), float("nan"), dtype=torch.float64) for t in (q, k, v))
    for b in range(3):
        s = slice(done[b], done[b] + rest[b])
        pq[b, T - rest[b] :], pk[b, T - rest[b] :], pv[b, T - rest[b] :] = q[b, s], k[b, s], v[b, s]
    num = torch.tensor(rest)
    out = cache.attend(0, pq, pk, pv, num_new=num)
    cache.attend(1, pq, pk, pv, num_new=num)
    cache.advance(num)
    for b in range(3):
        assert torch.equal(out[b, : T - rest[b]], torch.zeros_like(out[b, : T - rest[b]]))
    start = cache.seqlens.clone()
    outs = []
    for j in range(steps):
        pick = (start + j).tolist()
        qn, kn, vn = (torch.stack([t[b, pick[b]] for b in range(3)])[:, None] for t in (q, k, v))
        outs.append(cache.attend(0, qn, kn, vn))
        cache.attend(1, qn, kn, vn)
        cache.advance(1)
    for b in range(3):
        n = int(start[b]) + steps
        ref, _ = reference_attention(*(t[b : b + 1, :n] for t in (q, k, v)), segs, rates, True)
        if rest[b]:
            torch.testing.assert_close(
                out[b, T - rest[b] :], ref[0, done[b] : n - steps], rtol=1e-10, atol=1e-10
            )
        got = torch.cat([o[b] for o in outs])
        torch.testing.assert_close(got, ref[0, -steps:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_within_the_rule(dtype, fused):
    segs, rates, N = (8, 16, 32), (1, 2, 4), 40
    qkv = make_inputs(2, N, 4, 2, 16, dtype, seed=4, requires_grad=False)
    ref, ref_lse = reference_attention(*qkv, segs, rates, is_causal=True)
    plain, plain_lse = reference_attention(*qkv, segs, rates, is_causal=True, dtype=dtype)
    cache = BoundedDilatedKVCache(1, 2, 4, 2, 16, segs, rates, dtype=dtype, fused=fused)
    out, lse = decode_all(cache, qkv, [(0, 7)] + [(p, p + 1) for p in range(7, N)])
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_rule("bounded decode out", out, ref, plain, dtype)
    assert_within_rule("bounded decode lse", lse, ref_lse, plain_lse, dtype)


def test_memory_is_fixed_by_the_branches():
    """The README's decode branches: a kv head keeps sum_i min(G, r_i) * w_i / r_i = 34,816
    positions, under 5 % of a dense cache at 1M tokens; ``max_seqlen`` caps short generations."""
    segs, rates = [2048, 8192, 32768, 131072, 524288], [1, 4, 16, 64, 256]
    cache = BoundedDilatedKVCache(2, 1, 8, 2, 64, segs, rates, dtype=torch.float16, device="meta")
    assert cache.slots == 2048 + 4 * 4 * 2048 == 34816
    dense = 2 * 2 * (1 << 20) * 2 * 64 * 2  # layers, k and v, 1M positions, Hkv, D, bytes
    assert cache.memory_bytes() == 2 * 2 * 34816 * 2 * 64 * 2 and cache.memory_bytes() <= 0.05 * dense
    short = BoundedDilatedKVCache(1, 1, 8, 2, 64, segs, rates, max_seqlen=1000, device="meta")
    assert short.slots == 1000 + 4 * sum(math.ceil(1000 / r) for r in rates[1:])


def test_bad_arguments_name_the_value():
    cache = BoundedDilatedKVCache(1, 2, 4, 2, 8, (4, 8), (1, 2), max_seqlen=6)
    q, k = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 2, 8)
    with pytest.raises(ValueError, match="layer must be in"):
        cache.attend(1, q, k, k)
    with pytest.raises(ValueError, match=r"must match the cache's .* = \(2, 4, 2, 8\)"):
        cache.attend(0, q, q, q)
    with pytest.raises(ValueError, match=r"num_new must be in \[0, 1\].*got \[2, 0\]"):
        cache.attend(0, q, k, k, num_new=torch.tensor([2, 0]))
    with pytest.raises(ValueError, match=r"softmax_scale must be finite in the compute dtype"):
        cache.attend(0, q, k, k, softmax_scale=1e39)
    with pytest.raises(ValueError, match=r"beyond max_seqlen=6"):
        cache.attend(0, torch.zeros(2, 7, 4, 8), torch.zeros(2, 7, 2, 8), torch.zeros(2, 7, 2, 8))
    with pytest.raises(
        ValueError, match=r"holds the branches segment_lengths=\[4, 8\].*got \[4, 16\], \[1, 2\]"
    ):
        cache.attend(0, q, k, k, (4, 16), (1, 2))
    cache.attend(0, q, k, k, (4, 8), (1, 2))  # the cache's own branches, as DilatedKVCache takes them
    cache.reset()
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads, got 4 and 3"):
        BoundedDilatedKVCache(1, 2, 4, 3, 8, 4, 1)
    with pytest.raises(ValueError, match="dilation_rates"):
        BoundedDilatedKVCache(1, 2, 4, 2, 8, 4, 5)
    with pytest.raises(ValueError, match=r"dtype must be one of .* got torch\.int32"):
        BoundedDilatedKVCache(1, 2, 4, 2, 8, 4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"device must be .* got 'gpu0'"):
        BoundedDilatedKVCache(1, 2, 4, 2, 8, 4, 1, device="gpu0")
    with pytest.raises(ValueError, match="fused must be a bool, got 'yes'"):
        BoundedDilatedKVCache(1, 2, 4, 2, 8, 4, 1, fused="yes")
    with pytest.raises(ValueError, match="cache lengths must grow"):
        cache.advance(-1)
    out = cache.attend(0, q[:, :0], k[:, :0], k[:, :0])
    assert out.shape == (2, 0, 4, 8)
    with pytest.raises(ValueError, match=r"advance\(3\): layer 0 took 0 new tokens in every row"):
        cache.advance(3)  # no token was cached
    cache.advance(0)
    cache.reset()
    assert cache.seqlens.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_nan_query_gives_nan_like_the_reference(fused, dtype):
    """A NaN query (every score of its row NaN) gives NaN out and lse, as the reference and every
    other path do, not an empty row (out 0, lse -inf); a query with one NaN channel too. The other
    rows are unchanged."""
    Hq, Hkv, N, segs, rates = 4, 2, 29, (6, 12), (1, 3)
    q, k, v = make_inputs(2, N, Hq, Hkv, 8, torch.float64, seed=4, requires_grad=False)
    q[0, 7] = math.nan  # every head of position 7, in the prefill
    q[1, 20, 2] = math.nan  # one head, decoded alone
    q[0, 25, 1, 3] = math.nan  # one channel
    ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal=True)
    assert ref[0, 7].isnan().all() and ref_lse[0, :, 7].isnan().all() and ref_lse[1, 2, 20].isnan()
    cache = BoundedDilatedKVCache(1, 2, Hq, Hkv, 8, segs, rates, dtype=dtype, fused=fused)
    P = 10
    qkv = tuple(t.to(dtype) for t in (q, k, v))
    out, lse = decode_all(cache, qkv, [(0, P)] + [(p, p + 1) for p in range(P, N)])
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(lse.isnan(), ref_lse.isnan())
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_attending_a_layer_again_before_advance_warns(kind):
    """A layer that takes new tokens twice without advance() between writes the second call's tokens
    over the first's positions: a CacheUsageWarning says so (once) and names advance(); the
    documented order (every layer, then advance) stays silent."""
    from dilated_attention import CacheUsageWarning
    from dilated_attention._warnings import reset_warnings

    reset_warnings()
    cache = (
        BoundedDilatedKVCache(2, 1, 2, 1, 4, [4], [1], dtype=torch.float64)
        if kind == "bounded"
        else DilatedKVCache(2, 1, 8, 1, 4, dtype=torch.float64)
    )
    q, k = torch.randn(1, 1, 2, 4, dtype=torch.float64), torch.randn(1, 1, 1, 4, dtype=torch.float64)
    extra = () if kind == "bounded" else ([4], [1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheUsageWarning)
        for _ in range(3):  # three steps in the documented order
            cache.attend(0, q, k, k, *extra)
            cache.attend(1, q, k, k, *extra)
            cache.advance(1)
    with pytest.warns(CacheUsageWarning, match=r"attend\(layer=0\) was called again before advance\(\)"):
        cache.attend(0, q, k, k, *extra)
        cache.attend(0, q, k, k, *extra)
    cache.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheUsageWarning)
        cache.attend(0, q, k, k, *extra)  # reset() starts a new step
