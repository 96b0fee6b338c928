"""The key/value caches used out of their documented order (docs/decoding.md: every layer attends,
then ``advance`` by the tokens the layers took), meta tensors, and a cache for a device this
process does not have: a warning or an error naming the value, never a wrong answer or an error
from PyTorch's internals."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from common import one_thread  # noqa: F401  (an autouse fixture)

from dilated_attention import CacheUsageWarning, dilated_attention_decode
from dilated_attention.decode import BoundedDilatedKVCache, DilatedKVCache

SEGS, RATES = [4, 8], [1, 2]
B, HQ, HKV, D = 2, 4, 2, 8


def make_cache(kind: str, num_layers: int = 2, device: str | None = None):
    if kind == "bounded":
        return BoundedDilatedKVCache(
            num_layers, B, HQ, HKV, D, SEGS, RATES, dtype=torch.float64, device=device
        )
    return DilatedKVCache(num_layers, B, 32, HKV, D, dtype=torch.float64, device=device)


def attend(cache, layer: int, m: int, seed: int = 0, device: str | None = None, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, m, HQ, D, generator=g, dtype=torch.float64).to(device)
    k = torch.randn(B, m, HKV, D, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(B, m, HKV, D, generator=g, dtype=torch.float64).to(device)
    extra = () if isinstance(cache, BoundedDilatedKVCache) else (SEGS, RATES)
    return cache.attend(layer, q, k, v, *extra, **kw)


# ---------------------------------------------------------------- the order of calls


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_every_cache_that_forgets_advance_warns_once(kind):
    """The warning was keyed by the cache's class: a second cache that forgot advance() got wrong
    outputs without a word. Each cache now warns on its first misuse (once), even when the same
    line misuses both under Python's default filter (which shows a text once per line), and the
    flag lives on the cache: no global set keeps caches alive."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):  # two caches, the same lines
            cache = make_cache(kind)
            for step in range(3):  # advance() forgotten
                attend(cache, 0, 1, seed=step)
                attend(cache, 1, 1, seed=step)
    msgs = [w for w in caught if issubclass(w.category, CacheUsageWarning)]
    assert len(msgs) == 2, [str(w.message) for w in msgs]
    assert all("attend(layer=0) was called again before advance()" in str(w.message) for w in msgs)
    assert all(w.filename == __file__ for w in msgs)  # the user's line
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_the_documented_order_is_silent(kind):
    cache = make_cache(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, m in enumerate((5, 1, 1, 3)):
            attend(cache, 0, m, seed=step)
            attend(cache, 1, m, seed=step)
            cache.advance(m)
        attend(cache, 0, 1)
        attend(cache, 1, 1)
        cache.advance()  # without n: what the layers took
    assert cache.seqlens.tolist() == [11, 11]


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_advance_beyond_the_tokens_written_is_an_error(kind):
    """advance(5) after 4 tokens counted a position nobody wrote (the full cache's zeros, the
    bounded cache's stale slots) as cached, silently. Now a ValueError naming both numbers; the
    cache is unchanged and goes on as if advance(4) had been called."""
    cache, good = make_cache(kind), make_cache(kind)
    for c in (cache, good):
        attend(c, 0, 4)
        attend(c, 1, 4)
    what = "took" if kind == "bounded" else "appended"
    with pytest.raises(
        ValueError, match=rf"advance\(5\): layer 0 {what} 4 new tokens in every row .*got n = 5"
    ):
        cache.advance(5)
    with pytest.raises(ValueError, match=rf"advance\(\[4, 5\]\): layer 0 {what} 4 new tokens in every row"):
        cache.advance(torch.tensor([4, 5]))
    assert cache.seqlens.tolist() == [0, 0]
    cache.advance(4)
    good.advance(4)
    for layer in (0, 1):
        torch.testing.assert_close(
            attend(cache, layer, 1, seed=7), attend(good, layer, 1, seed=7), rtol=0, atol=0
        )


def test_full_cache_advances_right_padded_rows_by_their_real_lengths():
    """The full cache's documented use: prompts right-padded to T, advanced by the real lengths
    (at most T per row)."""
    cache = make_cache("full")
    attend(cache, 0, 4)
    attend(cache, 1, 4)
    cache.advance(torch.tensor([4, 2]))
    assert cache.seqlens.tolist() == [4, 2]


def test_bounded_cache_advances_by_exactly_num_new():
    """A left-padded prefill takes num_new[b] real tokens per row: advance by anything else (the
    padded length, or another count) is a ValueError naming the counts; advance() takes them."""
    cache = make_cache("bounded")
    num_new = torch.tensor([4, 2])
    attend(cache, 0, 4, num_new=num_new)
    attend(cache, 1, 4, num_new=num_new)
    with pytest.raises(
        ValueError, match=r"advance\(4\): layer 0 took \[4, 2\] new tokens per row .*got n = 4"
    ):
        cache.advance(4)
    with pytest.raises(ValueError, match=r"advance\(\[4, 3\]\): .*\[4, 2\] new tokens per row.*got \[4, 3\]"):
        cache.advance(torch.tensor([4, 3]))
    with pytest.raises(ValueError, match=r"advance\(\[4, 1\]\)"):
        cache.advance(torch.tensor([4, 1]))  # fewer is no right padding here: the slots hold [4, 2]
    assert cache.seqlens.tolist() == [0, 0]
    cache.advance()
    assert cache.seqlens.tolist() == [4, 2]


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_layers_that_took_different_tokens_are_named(kind):
    cache = make_cache(kind)
    attend(cache, 0, 4)
    attend(cache, 1, 3)
    with pytest.raises(
        ValueError, match=r"advance\(\) without n: .*layer 0 4 new tokens in every row, layer 1 3"
    ):
        cache.advance()
    with pytest.raises(ValueError, match=r"advance\(4\): layer 1 (took|appended) 3 new tokens"):
        cache.advance(4)
    if kind == "bounded":  # exactly what every layer took: none fits
        with pytest.raises(ValueError, match=r"advance\(3\): layer 0 took 4 new tokens"):
            cache.advance(3)
    else:  # at most what every layer appended
        cache.advance(3)
        assert cache.seqlens.tolist() == [3, 3]


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_advance_without_attend_counts_positions_written_directly(kind):
    """With no layer attended since the last advance, n counts positions the caller wrote into the
    cache itself (as the decode benchmark does) and is not checked; advance() has nothing to count."""
    cache = make_cache(kind)
    with pytest.raises(ValueError, match=r"advance\(\) without n: no layer took new tokens"):
        cache.advance()
    cache.advance(3)
    assert cache.seqlens.tolist() == [3, 3]
    attend(cache, 0, 1)
    attend(cache, 1, 1)
    cache.reset()
    with pytest.raises(ValueError, match="nothing to count"):
        cache.advance()  # reset() forgets the step too


# ---------------------------------------------------------------- meta tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_on_meta_tensors_propagates_shapes(dtype):
    """dilated_attention_decode on meta tensors gave 'Tensor.item() cannot be called on meta
    tensors'. It now gives the shapes and dtypes that the same call gives on the CPU (out in q's
    dtype, lse float32), checks the lengths that have values, and writes nothing."""
    Ncap = 16
    cases = [  # cache_seqlens, m, new keys given, cache_leftpad
        (0, 5, True, None),  # a prefill
        (3, 1, True, None),
        (torch.tensor([3, 7]), 2, True, None),
        (torch.tensor([3, 7]), 2, True, torch.tensor([1, 0])),
        (4, 2, False, None),
    ]
    for cache_seqlens, m, new, leftpad in cases:
        outs = []
        for dev in ("cpu", "meta"):
            q = torch.randn(B, m, HQ, D).to(dev, dtype)
            k = torch.randn(B, m, HKV, D).to(dev, dtype)
            kc, vc = (
                torch.zeros(B, Ncap, HKV, D, dtype=dtype, device=dev),
                torch.zeros(B, Ncap, HKV, D, dtype=dtype, device=dev),
            )
            lengths = cache_seqlens.to(dev) if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
            pad = None if leftpad is None else leftpad.to(dev)
            kv = {"k": k, "v": k} if new else {}
            outs.append(
                dilated_attention_decode(
                    q, kc, vc, lengths, SEGS, RATES, cache_leftpad=pad, return_lse=True, **kv
                )
            )
        (o_cpu, l_cpu), (o_meta, l_meta) = outs
        assert o_meta.device.type == "meta" and l_meta.device.type == "meta"
        assert (o_meta.shape, o_meta.dtype, l_meta.shape, l_meta.dtype) == (
            o_cpu.shape,
            o_cpu.dtype,
            l_cpu.shape,
            l_cpu.dtype,
        )
    q, kc = torch.empty(B, 1, HQ, D, device="meta"), torch.empty(B, Ncap, HKV, D, device="meta")
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 15\] .* got \[16, 16\]"):
        dilated_attention_decode(q, kc, kc, 16, SEGS, RATES, k=q[:, :, :HKV], v=q[:, :, :HKV])
    q_cpu, kc_cpu = torch.randn(B, 1, HQ, D), torch.zeros(B, Ncap, HKV, D)
    with pytest.raises(ValueError, match=r"cache_seqlens is a meta tensor \(it holds no values\)"):
        dilated_attention_decode(q_cpu, kc_cpu, kc_cpu, torch.tensor([3, 4], device="meta"), SEGS, RATES)


@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_cache_on_meta_tensors_propagates_shapes(kind):
    """A cache built on the meta device took meta q, k, v into torch.nonzero's meta kernel (an
    internal NotImplementedError) or Tensor.item(). It now gives out (and lse) of the right shapes
    and counts the lengths; a meta query on a CPU cache is a ValueError naming both devices."""
    cache = make_cache(kind, device="meta")
    for step, (m, num_new) in enumerate(((5, torch.tensor([5, 3])), (1, None), (3, None))):
        kw = {"num_new": num_new} if kind == "bounded" and num_new is not None else {}
        for layer in (0, 1):
            out = attend(cache, layer, m, seed=step, device="meta", **kw)
            assert out.shape == (B, m, HQ, D) and out.device.type == "meta" and out.dtype == torch.float64
        cache.advance(num_new if kind == "bounded" and num_new is not None else m)
    if kind == "bounded":
        assert cache._host == [9, 7]
        out, lse = attend(cache, 0, 1, device="meta", return_lse=True)
        assert lse.shape == (B, HQ, 1) and lse.dtype == torch.float64 and lse.device.type == "meta"
    with pytest.raises(ValueError, match=r"device"):
        attend(cache, 1, 1)  # CPU tensors on a meta cache
    cpu_cache = make_cache(kind)
    match = (
        r"cache's device cpu, got meta"
        if kind == "bounded"
        else r"q's dtype and device .*meta.*got torch.float64, cpu"
    )
    with pytest.raises(ValueError, match=match):
        attend(cpu_cache, 0, 1, device="meta")


def test_bounded_cache_on_meta_refuses_meta_lengths_by_name():
    cache = make_cache("bounded", device="meta")
    with pytest.raises(ValueError, match=r"num_new is a meta tensor \(it holds no values\)"):
        attend(cache, 0, 2, device="meta", num_new=torch.tensor([2, 1], device="meta"))


# ---------------------------------------------------------------- devices this process lacks


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a cache for CUDA where CUDA is not available")
@pytest.mark.parametrize("kind", ["bounded", "full"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cache_for_an_unavailable_device_is_refused_at_construction(kind, device):
    """A cache for "cuda" on a PyTorch that sees no GPU raised the driver's RuntimeError ("Found no
    NVIDIA driver on your system") from torch.zeros; now a ValueError at construction naming the
    device and why."""
    name = str(torch.device(device))
    with pytest.raises(
        ValueError,
        match=rf"cannot hold the cache on device='{name}': .*torch\.cuda\.is_available\(\) is False",
    ):
        make_cache(kind, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a cache for CUDA where CUDA is not available")
def test_cache_on_an_unavailable_default_device_is_refused():
    torch.set_default_device("cuda")
    try:
        with pytest.raises(
            ValueError, match=r"torch's default device .*torch\.cuda\.is_available\(\) is False"
        ):
            make_cache("bounded")
    finally:
        torch.set_default_device(None)
