"""Decoding with a key/value cache (SPEC section 8): ``dilated_attention_decode`` and
``DilatedKVCache`` against the float64 reference of the whole causal sequence, token by token."""

from __future__ import annotations

import math

import pytest
import torch
from common import make_inputs, one_thread  # noqa: F401  (one_thread: an autouse fixture)
from reference import multiplicity, reference_attention
from tolerance import assert_within_rule

from dilated_attention import BACKEND_NAMES, BoundedDilatedKVCache, DilatedKVCache, dilated_attention_decode
from dilated_attention import decode as decode_mod
from dilated_attention.backends import BackendRequest, backend_reasons
from dilated_attention.decode import decode_key_positions

# (Hq, Hkv, N, segment_lengths, dilation_rates)
SHAPES = [
    pytest.param(4, 4, 40, (8, 16, 32), (1, 2, 4), id="three-branches-ragged"),
    pytest.param(4, 2, 29, (6, 12), (1, 3), id="gqa-ragged"),
    pytest.param(2, 1, 24, (8,), (4,), id="uncovered-rows"),  # r > Hq: some (p, h) read nothing
    pytest.param(2, 2, 20, (32, 4), (2, 1), id="w-greater-than-N"),
]


def runnable_backends() -> list[str]:
    reasons = backend_reasons(BackendRequest(torch.device("cpu"), torch.float64, 8))
    return [name for name in BACKEND_NAMES if not reasons[name]]


@pytest.mark.parametrize("Hq,Hkv,N,segs,rates", SHAPES)
def test_key_positions_are_the_reference_rows(Hq, Hkv, N, segs, rates):
    """The slots a query reads are its row of the reference's causal multiplicity mask (a key read
    through two branches twice), and there are at most sum ceil(w/r) of them."""
    mult = multiplicity(N, Hq, segs, rates, is_causal=True)  # (Hq, N, N)
    pos = torch.arange(N)
    keys, mask = decode_key_positions(pos, Hq, segs, rates)  # (N, K), (N, Hq, K)
    assert keys.shape[-1] <= sum(math.ceil(w / r) for w, r in zip(segs, rates, strict=True))
    counts = torch.zeros(Hq, N, N, dtype=torch.int64)
    for p in range(N):
        for h in range(Hq):
            counts[h, p].index_add_(
                0, keys[p][mask[p, h]], torch.ones(int(mask[p, h].sum()), dtype=torch.int64)
            )
    assert torch.equal(counts, mult)
    # Padding queries (negative positions) read nothing.
    _, mask = decode_key_positions(torch.tensor([-1, -5]), Hq, segs, rates, max_position=N)
    assert not mask.any()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("Hq,Hkv,N,segs,rates", SHAPES)
def test_token_by_token_equals_full_causal_forward(backend, Hq, Hkv, N, segs, rates):
    """Prefill a prompt (by ``backend``), then one token at a time: out and lse of every position
    equal the float64 reference of the whole causal sequence."""
    if backend not in runnable_backends():
        pytest.skip(f"{backend} cannot run float64 on this machine")
    q, k, v = make_inputs(2, N, Hq, Hkv, 8, torch.float64, seed=1, requires_grad=False)
    ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal=True)
    kc = torch.zeros(2, N + 2, Hkv, 8, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    P = 5
    out, lse = dilated_attention_decode(
        q[:, :P], kc, vc, 0, segs, rates, k=k[:, :P], v=v[:, :P], return_lse=True, backend=backend
    )
    outs, lses = [out], [lse]
    for p in range(P, N):
        s = slice(p, p + 1)
        out, lse = dilated_attention_decode(
            q[:, s], kc, vc, p, segs, rates, k=k[:, s], v=v[:, s], return_lse=True, backend=backend
        )
        outs.append(out)
        lses.append(lse)
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(lses, -1), ref_lse, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kc[:, :N], k, rtol=0, atol=0)  # the new keys were appended


def test_sequences_of_different_lengths_and_left_padding():
    """A batch whose sequences have different cached lengths (cache_seqlens per sequence) and one
    whose sequences start after left padding (cache_leftpad): each row equals the reference of its
    own sequence; padding queries give 0 and -inf."""
    Hq, Hkv, segs, rates = 4, 2, (4, 8, 16), (1, 2, 4)
    lengths = [7, 19, 12]
    q, k, v = make_inputs(3, 19, Hq, Hkv, 8, torch.float64, seed=2, requires_grad=False)
    kc = torch.zeros(3, 24, Hkv, 8, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    for b, n in enumerate(lengths):
        kc[b, :n], vc[b, :n] = k[b, :n], v[b, :n]
    seqlens = torch.tensor(lengths)
    qn = torch.stack([q[b, n - 1] for b, n in enumerate(lengths)])[:, None]  # (3, 1, Hq, D)
    out = dilated_attention_decode(qn, kc, vc, seqlens, segs, rates)  # k=None: the cache holds them
    for b, n in enumerate(lengths):
        ref, _ = reference_attention(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], segs, rates, True)
        torch.testing.assert_close(out[b, 0], ref[0, -1], rtol=1e-10, atol=1e-10)

    # The same sequences left-padded to 19 slots, the last 3 tokens of each decoded at once.
    pad = torch.tensor([19 - n for n in lengths])
    kl = torch.full((3, 19, Hkv, 8), float("nan"), dtype=torch.float64)  # padding is never read
    vl = kl.clone()
    ql = torch.zeros(3, 19, Hq, 8, dtype=torch.float64)
    for b, n in enumerate(lengths):
        kl[b, 19 - n :], vl[b, 19 - n :], ql[b, 19 - n :] = k[b, :n], v[b, :n], q[b, :n]
    out, lse = dilated_attention_decode(
        ql[:, -3:], kl, vl, 19, segs, rates, cache_leftpad=pad, return_lse=True
    )
    for b, n in enumerate(lengths):
        ref, ref_lse = reference_attention(
            q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], segs, rates, True
        )
        torch.testing.assert_close(out[b], ref[0, -3:], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[b], ref_lse[0, :, -3:], rtol=1e-10, atol=1e-10)
    # A row that is all padding: its queries read nothing.
    out, lse = dilated_attention_decode(
        ql[:, -2:], kl, vl, 19, segs, rates, cache_leftpad=torch.tensor([19, 0, 0]), return_lse=True
    )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


def test_chunks_of_new_tokens(monkeypatch):
    """Several new tokens after a non-empty cache (chunked prefill), split into gather chunks."""
    monkeypatch.setattr(decode_mod._gather, "_GATHER_BUDGET", 1)  # one query per chunk
    segs, rates = (8, 16), (1, 2)
    q, k, v = make_inputs(2, 30, 4, 4, 8, torch.float64, seed=3, requires_grad=False)
    ref, _ = reference_attention(q, k, v, segs, rates, is_causal=True)
    kc = torch.zeros(2, 30, 4, 8, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    outs = []
    for a, b in ((0, 11), (11, 12), (12, 30)):
        outs.append(dilated_attention_decode(q[:, a:b], kc, vc, a, segs, rates, k=k[:, a:b], v=v[:, a:b]))
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_within_the_rule(dtype):
    segs, rates = (8, 16, 32), (1, 2, 4)
    N = 40
    q, k, v = make_inputs(2, N, 4, 2, 16, dtype, seed=4, requires_grad=False)
    ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal=True)
    plain, plain_lse = reference_attention(q, k, v, segs, rates, is_causal=True, dtype=dtype)
    kc = torch.zeros(2, N, 2, 16, dtype=dtype)
    vc = torch.zeros_like(kc)
    outs, lses = [], []
    for p in range(N):
        s = slice(p, p + 1)
        o, lse = dilated_attention_decode(
            q[:, s], kc, vc, p, segs, rates, k=k[:, s], v=v[:, s], return_lse=True
        )
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs, 1), torch.cat(lses, -1)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_rule("decode out", out, ref, plain, dtype)
    assert_within_rule("decode lse", lse, ref_lse, plain_lse, dtype)


@pytest.mark.parametrize("bounded", [False, True], ids=["full", "bounded"])
def test_cache_computes_in_its_dtype_and_returns_q_dtype(bounded):
    """Both caches take q, k, v of another dtype: they are rounded to the cache's (float32 here),
    the result is the float64 reference of the rounded inputs, returned in q's dtype."""
    segs, rates, N = (4, 8), (1, 2), 12
    q, k, v = make_inputs(1, N, 2, 2, 8, torch.float64, seed=5, requires_grad=False)
    r32 = [t.float().double() for t in (q, k, v)]
    ref, _ = reference_attention(*r32, segs, rates, is_causal=True)
    if bounded:
        cache = BoundedDilatedKVCache(1, 1, 2, 2, 8, segs, rates, dtype=torch.float32)
    else:
        cache = DilatedKVCache(1, 1, N, 2, 8, dtype=torch.float32)
    outs = []
    for p in range(N):
        s = slice(p, p + 1)
        outs.append(
            cache.attend(0, q[:, s], k[:, s], v[:, s])
            if bounded
            else cache.attend(0, q[:, s], k[:, s], v[:, s], segs, rates)
        )
        cache.advance(1)
    out = torch.cat(outs, 1)
    assert out.dtype == torch.float64 and cache.k[0].dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-6)


def test_cache_with_prompts_of_different_lengths():
    """DilatedKVCache: right-padded prompts prefilled together, advanced by their real lengths,
    then decoded in lockstep; every row equals the reference of its own sequence."""
    L, Hq, Hkv, segs, rates = 2, 4, 2, (4, 8), (1, 2)
    lengths = torch.tensor([3, 9])
    steps = 6
    N = int(lengths.max()) + steps
    qs = [make_inputs(2, N, Hq, Hkv, 8, torch.float64, seed=10 + i, requires_grad=False) for i in range(L)]
    cache = DilatedKVCache(L, 2, N, Hkv, 8, dtype=torch.float64)
    T = int(lengths.max())
    outs = [[cache.attend(i, *(t[:, :T] for t in qs[i]), segs, rates)] for i in range(L)]
    cache.advance(lengths)
    for j in range(steps):
        for i in range(L):
            q, k, v = qs[i]
            pick = [lengths[b] + j for b in range(2)]
            qn, kn, vn = (torch.stack([t[b, pick[b]] for b in range(2)])[:, None] for t in (q, k, v))
            outs[i].append(cache.attend(i, qn, kn, vn, segs, rates))
        cache.advance(1)
    assert cache.seqlens.tolist() == (lengths + steps).tolist()
    for i in range(L):
        q, k, v = qs[i]
        for b in range(2):
            n = int(lengths[b])
            ref, _ = reference_attention(*(t[b : b + 1, : n + steps] for t in (q, k, v)), segs, rates, True)
            got = torch.cat([outs[i][0][b, :n], *(o[b] for o in outs[i][1:])])
            torch.testing.assert_close(got, ref[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="cache lengths must stay in"):
        cache.advance(N)
    cache.reset()
    assert cache.seqlens.tolist() == [0, 0]


def test_bad_arguments_name_the_value():
    q = torch.zeros(2, 1, 4, 8)
    kc = torch.zeros(2, 10, 2, 8)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 9\].*got \[10, 10\]"):
        dilated_attention_decode(q, kc, kc, 10, 4, 1, k=q[:, :, :2], v=q[:, :, :2])
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[1, 10\].*got \[0, 0\]"):
        dilated_attention_decode(q, kc, kc, 0, 4, 1)
    with pytest.raises(ValueError, match="both k and v"):
        dilated_attention_decode(q, kc, kc, 1, 4, 1, k=q[:, :, :2])
    with pytest.raises(ValueError, match=r"integer tensor, got dtype torch\.float32"):
        dilated_attention_decode(q, kc, kc, torch.tensor([1.0, 2.0]), 4, 1)
    with pytest.raises(ValueError, match=r"\(2,\) tensor, got shape \(3,\)"):
        dilated_attention_decode(q, kc, kc, torch.tensor([1, 2, 3]), 4, 1)
    with pytest.raises(ValueError, match="must agree in B and D"):
        dilated_attention_decode(q, torch.zeros(2, 10, 3, 8), torch.zeros(2, 10, 3, 8), 1, 4, 1)
    with pytest.raises(ValueError, match="k_cache must have q's dtype"):
        dilated_attention_decode(q, kc.double(), kc.double(), 1, 4, 1)
    with pytest.raises(ValueError, match="cache_leftpad must be in"):
        dilated_attention_decode(q, kc, kc, 1, 4, 1, cache_leftpad=torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="dilation_rates"):
        dilated_attention_decode(q, kc, kc, 1, 4, 5)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        dilated_attention_decode(q, kc, kc, 1, 4, 1, backend="fast")
    with pytest.raises(ValueError, match="layer must be in"):
        DilatedKVCache(1, 2, 4, 2, 8).attend(1, q, q[:, :, :2], q[:, :, :2], 4, 1)
    with pytest.raises(ValueError, match=r"dtype must be one of .* got torch\.int64"):
        DilatedKVCache(1, 2, 4, 2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"device must be .* got 'gpu0'"):
        DilatedKVCache(1, 2, 4, 2, 8, device="gpu0")


@pytest.mark.parametrize("layout", ["bnhd", "bhnd-transposed", "sliced", "d-strided", "expanded-batch"])
def test_gather_reads_any_cache_layout(layout):
    """The slot gather against plain indexing, for caches in the layouts users hold them in."""
    B, N, H, D = 3, 17, 2, 4
    base = torch.arange(B * N * H * D, dtype=torch.float64).view(B, N, H, D)
    cache = {
        "bnhd": base,
        "bhnd-transposed": base.transpose(1, 2).contiguous().transpose(1, 2),
        "sliced": torch.cat([base, base], dim=1)[:, 3 : 3 + N],
        "d-strided": torch.cat([base, base], dim=-1)[..., ::2],
        "expanded-batch": base[:1].expand(B, N, H, D),
    }[layout]
    idx = torch.randint(0, N, (B, 2, 5))
    expected = torch.stack([cache[b][idx[b]] for b in range(B)])  # (B, 2, 5, H, D)
    assert torch.equal(decode_mod._gather._gather_slots(cache, idx), expected.transpose(2, 3))


def test_readme_snippet_runs():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("## Generation in bounded memory")
    code = readme[
        readme.index("```python\n", start) + 10 : readme.index("```\n", readme.index("```python\n", start))
    ]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["out"].shape == (2, 1, 8, 64) and scope["cache"].seqlens.tolist() == [101, 61]


def test_empty_batch_and_no_new_queries():
    kc = torch.zeros(2, 8, 2, 8)
    out, lse = dilated_attention_decode(torch.zeros(2, 0, 4, 8), kc, kc, 3, 4, 1, return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)
    out = dilated_attention_decode(torch.zeros(0, 1, 4, 8), kc[:0], kc[:0], 3, 4, 1)
    assert out.shape == (0, 1, 4, 8)


def test_scale_must_be_finite_in_the_compute_dtype():
    """A scale that overflows float32 scores is refused with the functional API's error (it gave
    NaN), for float32 and the half types; float64 computes in float64 and accepts it."""
    kc = torch.zeros(1, 8, 2, 8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, c = torch.zeros(1, 1, 4, 8, dtype=dtype), kc.to(dtype)
        with pytest.raises(
            ValueError, match=r"softmax_scale must be finite in the compute dtype float32.*1e\+39"
        ):
            dilated_attention_decode(q, c, c, 1, 4, 1, softmax_scale=1e39)
    q, k, v = make_inputs(1, 6, 4, 2, 8, torch.float64, seed=5, requires_grad=False)
    assert torch.isfinite(dilated_attention_decode(q[:, -1:], k, v, 6, 4, 1, softmax_scale=1e39)).all()


@pytest.mark.parametrize("lengths", ["int", "tensor"])
def test_torch_compile_fullgraph(lengths):
    """``dilated_attention_decode`` compiles with ``fullgraph=True`` (no graph break), with int or
    tensor cache lengths and left padding, and equals the float64 reference."""
    Hq, Hkv, segs, rates, N = 4, 2, (4, 8), (1, 2), 13
    q, k, v = make_inputs(2, N, Hq, Hkv, 8, torch.float64, seed=6, requires_grad=False)
    ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal=True)
    seqlens = N - 1 if lengths == "int" else torch.tensor([N - 1, N - 1])
    pad = None if lengths == "int" else torch.tensor([0, 0])

    def step(q, kc, vc, k, v):
        return dilated_attention_decode(
            q, kc, vc, seqlens, segs, rates, k=k, v=v, cache_leftpad=pad, return_lse=True
        )

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    kc = torch.zeros(2, N + 3, Hkv, 8, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    kc[:, : N - 1], vc[:, : N - 1] = k[:, :-1], v[:, :-1]
    out, lse = compiled(q[:, -1:], kc, vc, k[:, -1:], v[:, -1:])
    torch.testing.assert_close(out[:, 0], ref[:, -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse[..., 0], ref_lse[..., -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kc[:, N - 1], k[:, -1], rtol=0, atol=0)  # appended in place
