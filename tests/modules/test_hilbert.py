"""Hilbert-curve token order (dilated_attention.hilbert): the permutation itself, its locality, and
attention run in curve order against the float64 dense reference on pre-permuted inputs."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from reference import reference_attention
from tolerance import assert_within_rule

from dilated_attention import dilated_attention as dattn
from dilated_attention import hilbert as hb
from dilated_attention.hilbert import from_curve_order, hilbert_permutation, segment_locality, to_curve_order

SLOW = os.environ.get("DILATED_ATTENTION_SLOW") == "1"


# --------------------------------------------------------------------------------------------
# Independent checks of a curve, written from the definition only.


def assert_unit_step_bijection(perm: torch.Tensor, inv: torch.Tensor, height: int, width: int) -> None:
    n = height * width
    label = f"{height}x{width}"
    assert perm.dtype == torch.int64 and inv.dtype == torch.int64, label
    assert perm.device.type == "cpu" and inv.device.type == "cpu", label
    assert perm.shape == (n,) and inv.shape == (n,), label
    # A bijection of range(n), and inv is its inverse on both sides.
    assert torch.equal(torch.sort(perm).values, torch.arange(n)), f"{label}: not a permutation"
    assert torch.equal(perm[inv], torch.arange(n)), f"{label}: perm[inv] != identity"
    assert torch.equal(inv[perm], torch.arange(n)), f"{label}: inv[perm] != identity"
    # Consecutive cells along the curve are 4-neighbours.
    rows, cols = perm // width, perm % width
    steps = (rows[1:] - rows[:-1]).abs() + (cols[1:] - cols[:-1]).abs()
    bad = torch.nonzero(steps != 1).flatten().tolist()
    assert not bad, f"{label}: {len(bad)} non-unit steps, first at curve index {bad[0]}"


def classic_hilbert_d2xy(order: int, d: int) -> tuple[int, int]:
    """The textbook Hilbert curve on a 2^k x 2^k grid (``order = 2^k``): cell number ``d``."""
    x = y = 0
    s, t = 1, d
    while s < order:
        rx = 1 & (t // 2)
        ry = 1 & (t ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x, y = x + s * rx, y + s * ry
        t //= 4
        s *= 2
    return x, y


SIZES = [
    (1, 1),
    (1, 2),
    (2, 1),
    (1, 1000),
    (1000, 1),
    (2, 2),
    (2, 999),
    (999, 2),
    (3, 3),
    (3, 200),
    (5, 4),
    (4, 5),
    (7, 2),
    (9, 8),
    (8, 9),
    (97, 89),
    (89, 97),
    (101, 4),
    (4, 101),
    (127, 64),
    (64, 127),
    (128, 128),
    (255, 256),
    (257, 129),
    (224, 224),
    (14, 14),
    (16, 9),
    (480, 640),
]


@pytest.mark.parametrize("height,width", SIZES, ids=lambda v: str(v))
def test_bijection_with_unit_steps(height, width):
    perm, inv = hilbert_permutation(height, width)
    assert_unit_step_bijection(perm, inv, height, width)
    assert perm[0].item() == 0  # starts in the corner (0, 0)


def test_every_size_up_to_48():
    for height in range(1, 49):
        for width in range(1, 49):
            perm, inv = hilbert_permutation(height, width)
            assert_unit_step_bijection(perm, inv, height, width)


@pytest.mark.skipif(
    not SLOW, reason="set DILATED_ATTENTION_SLOW=1 for the sweep over all sizes up to 128 x 128"
)
def test_every_size_up_to_128():
    for height in range(1, 129):
        for width in range(1, 129):
            perm, inv = hb._cached_permutation.__wrapped__(height, width)
            assert_unit_step_bijection(perm, inv, height, width)


@pytest.mark.parametrize("order", [1, 2, 4, 8, 16, 64])
def test_powers_of_two_give_the_classic_hilbert_curve(order):
    """On a 2^k square the generalized curve is the textbook one (up to a symmetry of the square),
    hence every aligned run of 4^j cells fills a 2^j x 2^j square: a Hilbert curve, not a snake."""
    perm, _ = hilbert_permutation(order, order)
    rows, cols = (perm // order).tolist(), (perm % order).tolist()
    classic = [classic_hilbert_d2xy(order, d) for d in range(order * order)]
    m = order - 1
    symmetries = [
        lambda x, y: (x, y),
        lambda x, y: (y, x),
        lambda x, y: (m - x, y),
        lambda x, y: (x, m - y),
        lambda x, y: (m - x, m - y),
        lambda x, y: (m - y, x),
        lambda x, y: (y, m - x),
        lambda x, y: (m - y, m - x),
    ]
    ours = list(zip(rows, cols, strict=True))
    assert any([f(x, y) for x, y in classic] == ours for f in symmetries)
    block = 1
    while block * block <= order * order:
        run = block * block
        for start in range(0, order * order, run):
            r, c = rows[start : start + run], cols[start : start + run]
            assert max(r) - min(r) == block - 1 and max(c) - min(c) == block - 1
            assert min(r) % block == 0 and min(c) % block == 0
        block *= 2


def plain_algorithm_cells(height: int, width: int) -> list[tuple[int, int]]:
    """(row, col) of the cells along the published algorithm's curve, whose end is fixed."""
    runs: list = []
    if width >= height:
        hb._fill(0, 0, width, 0, 0, height, runs)
    else:
        hb._fill(0, 0, 0, height, width, 0, runs)
    return [(y + dy * i, x + dx * i) for x, y, dx, dy, n in runs for i in range(n)]


def test_the_documented_exception_of_the_published_algorithm():
    """The published algorithm (the corner-to-corner recursion used inside) makes exactly one
    diagonal step when the longer side is odd and the shorter even and >= 4, and none otherwise;
    hilbert_permutation has none for the same sizes (checked above)."""
    for height in range(1, 25):
        for width in range(1, 25):
            cells = plain_algorithm_cells(height, width)
            assert sorted(cells) == [(r, c) for r in range(height) for c in range(width)]
            non_unit = sum(abs(a[0] - b[0]) + abs(a[1] - b[1]) != 1 for a, b in itertools.pairwise(cells))
            diagonal = sum(
                abs(a[0] - b[0]) == 1 and abs(a[1] - b[1]) == 1 for a, b in itertools.pairwise(cells)
            )
            longer, shorter = max(height, width), min(height, width)
            expected = 1 if longer % 2 == 1 and shorter % 2 == 0 and shorter >= 4 else 0
            assert non_unit == expected and diagonal == expected, (height, width, non_unit, diagonal)


def test_cache_cannot_be_corrupted_by_the_caller():
    perm, inv = hilbert_permutation(6, 10)
    perm.zero_()
    inv.fill_(3)
    perm2, inv2 = hilbert_permutation(6, 10)
    assert_unit_step_bijection(perm2, inv2, 6, 10)


def test_accepts_integer_like_sizes():
    np = pytest.importorskip("numpy")
    perm, inv = hilbert_permutation(np.int64(5), torch.tensor(7))
    assert_unit_step_bijection(perm, inv, 5, 7)


@pytest.mark.parametrize(
    "height,width,error,match",
    [
        (0, 4, ValueError, r"height must be >= 1, got height=0"),
        (4, -3, ValueError, r"width must be >= 1, got width=-3"),
        (True, 4, TypeError, r"bool height=True"),
        (4, False, TypeError, r"bool width=False"),
        (4.0, 4, TypeError, r"height=4\.0 of type float"),
        (4, "8", TypeError, r"width='8' of type str"),
        (None, 4, TypeError, r"height=None"),
    ],
)
def test_bad_sizes(height, width, error, match):
    with pytest.raises(error, match=match):
        hilbert_permutation(height, width)


# --------------------------------------------------------------------------------------------
# Reordering helpers.


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_reorder_round_trip(dim):
    height, width = 5, 7
    perm, inv = hilbert_permutation(height, width)
    shape = [3, 4, 2, 6]
    shape[dim] = height * width
    x = torch.randn(*shape, dtype=torch.float64)
    curve = to_curve_order(x, perm, dim=dim)
    # Plain indexing, written independently: curve position i holds row-major token perm[i].
    expected = x.movedim(dim, 0)[perm].movedim(0, dim)
    assert torch.equal(curve, expected)
    assert torch.equal(from_curve_order(curve, inv, dim=dim), x)
    assert torch.equal(curve.movedim(dim, 0)[inv].movedim(0, dim), x)


def test_reorder_is_differentiable():
    perm, inv = hilbert_permutation(3, 4)
    x = torch.randn(2, 12, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 12, 3, dtype=torch.float64)
    (to_curve_order(x, perm) * weight).sum().backward()
    assert torch.equal(x.grad, weight[:, inv])


def test_reorder_rejects_a_wrong_length():
    perm, inv = hilbert_permutation(4, 5)
    x = torch.zeros(1, 21, 2, 8)
    with pytest.raises(ValueError, match=r"sequence length 21 .* does not match the 20 cells"):
        to_curve_order(x, perm)
    with pytest.raises(ValueError, match=r"sequence length 21 .* does not match the 20 cells"):
        from_curve_order(x, inv)
    with pytest.raises(ValueError, match=r"dim=4"):
        to_curve_order(torch.zeros(1, 20, 2, 8), perm, dim=4)
    with pytest.raises(TypeError, match=r"perm must be a 1-D int64 tensor"):
        to_curve_order(torch.zeros(1, 20), perm.float())
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        to_curve_order([0] * 20, perm)


# --------------------------------------------------------------------------------------------
# Locality.


def naive_locality(order: list[int], width: int, segment_length: int) -> float:
    total = 0.0
    for start in range(0, len(order), segment_length):
        cells = [(t // width, t % width) for t in order[start : start + segment_length]]
        cr = sum(r for r, _ in cells) / len(cells)
        cc = sum(c for _, c in cells) / len(cells)
        total += sum(math.hypot(r - cr, c - cc) for r, c in cells)
    return total / len(order)


def test_segment_locality_definition():
    # 2 x 2 grid by hand: row-major segments of 2 are rows (each cell 0.5 from the middle); the
    # curve's single segment of 4 is the square, each cell sqrt(0.5) from its centre.
    assert segment_locality(torch.arange(4), 2, 2, 2) == pytest.approx(0.5)
    perm, _ = hilbert_permutation(2, 2)
    assert segment_locality(perm, 2, 2, 4) == pytest.approx(math.sqrt(0.5))
    # A random order on an odd grid with a ragged last segment, against a plain loop.
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(7 * 9, generator=g)
    for seg in (1, 4, 10, 63, 100):
        assert segment_locality(order, 7, 9, seg) == pytest.approx(naive_locality(order.tolist(), 9, seg))


def test_segment_locality_bad_inputs():
    with pytest.raises(ValueError, match=r"permutation of range\(12\)"):
        segment_locality(torch.arange(11), 3, 4, 4)
    with pytest.raises(ValueError, match=r"permutation of range\(12\)"):
        segment_locality(torch.zeros(12, dtype=torch.int64), 3, 4, 4)
    with pytest.raises(ValueError, match=r"segment_length=0"):
        segment_locality(torch.arange(12), 3, 4, 0)
    with pytest.raises(TypeError, match=r"1-D integer tensor"):
        segment_locality(torch.arange(12.0), 3, 4, 4)


@pytest.mark.parametrize(
    "height,width,segment_length",
    [
        (64, 64, 16),
        (64, 64, 64),
        (37, 53, 64),
        (53, 37, 32),
        (17, 120, 64),
        (31, 31, 16),
        (9, 8, 8),
        (256, 256, 1024),
    ],
)
def test_hilbert_segments_are_more_compact_than_row_major(height, width, segment_length):
    perm, _ = hilbert_permutation(height, width)
    hilbert = segment_locality(perm, height, width, segment_length)
    row_major = segment_locality(torch.arange(height * width), height, width, segment_length)
    assert hilbert < 0.6 * row_major, (hilbert, row_major)


# --------------------------------------------------------------------------------------------
# Attention in curve order (functional API plus the helpers) against the reference on
# pre-permuted inputs.


def make_inputs(B, N, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)]


def reference_in_curve_order(q, k, v, perm, inv, segs, rates, is_causal, dtype=None):
    """The dense reference on inputs permuted by plain indexing, its outputs un-permuted."""
    out, lse = reference_attention(
        q[:, perm], k[:, perm], v[:, perm], segs, rates, is_causal=is_causal, dtype=dtype
    )
    return out[:, inv], lse[:, :, inv]  # (B, N, Hq, D), (B, Hq, N)


ATTN_CONFIGS = [
    # (B, grid, Hq, Hkv, D, segment_lengths, dilation_rates)
    pytest.param(2, (6, 7), 4, 2, 8, [8, 16], [1, 2], id="6x7-gqa"),
    pytest.param(1, (5, 8), 2, 2, 16, [4, 12, 40], [1, 2, 4], id="5x8-three-branches"),
    pytest.param(1, (9, 4), 3, 1, 8, [16], [4], id="9x4-uncovered-rows"),
    pytest.param(1, (1, 13), 2, 1, 4, [5], [1], id="1x13"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,grid,Hq,Hkv,D,segs,rates", ATTN_CONFIGS)
def test_functional_attention_in_curve_order_matches_reference(
    B, grid, Hq, Hkv, D, segs, rates, is_causal, dtype
):
    perm, inv = hilbert_permutation(*grid)
    N = grid[0] * grid[1]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype)
    out_c, lse_c = dattn(
        to_curve_order(q, perm),
        to_curve_order(k, perm),
        to_curve_order(v, perm),
        segs,
        rates,
        is_causal=is_causal,
        return_lse=True,
    )
    out, lse = from_curve_order(out_c, inv), from_curve_order(lse_c, inv, dim=2)
    ref_out, ref_lse = reference_in_curve_order(q, k, v, perm, inv, segs, rates, is_causal)
    plain_out, plain_lse = reference_in_curve_order(q, k, v, perm, inv, segs, rates, is_causal, dtype=dtype)
    assert_within_rule("out", out, ref_out, plain_out, dtype)
    assert_within_rule("lse", lse, ref_lse, plain_lse, dtype)
    # Backward through the reordering: gradients of <out, dout>.
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * dout).sum(), (q, k, v))
    plain = torch.autograd.grad((plain_out.double() * dout).sum(), (q, k, v))
    for name, a, e, p in zip(("dq", "dk", "dv"), got, want, plain, strict=True):
        assert_within_rule(name, a, e, p, dtype)


def test_curve_order_changes_the_result():
    """The order matters (so the comparisons above can fail): curve-order attention differs from
    row-major attention when segments are shorter than the sequence."""
    perm, inv = hilbert_permutation(8, 8)
    q, k, v = (t.detach() for t in make_inputs(1, 64, 2, 2, 8, torch.float64))
    row_major = dattn(q, k, v, [16], [1])
    curve = from_curve_order(
        dattn(to_curve_order(q, perm), to_curve_order(k, perm), to_curve_order(v, perm), [16], [1]), inv
    )
    assert (row_major - curve).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# The ordering="hilbert", grid=(H, W) option of the modules, against the reference on
# pre-permuted inputs, forward and backward, for each backend that can run on this machine.

MODULE_BACKENDS = ["native", "sdpa", "manual"]


def modules_or_skip():
    return pytest.importorskip(
        "dilated_attention.modules", reason="dilated_attention.modules is not available"
    )


def runnable_backend_or_skip(name: str, q: torch.Tensor, k: torch.Tensor) -> None:
    """Skips unless the backend exists and can run these inputs itself (no fallback)."""
    backends = pytest.importorskip("dilated_attention.backends")
    if name not in getattr(backends, "BACKEND_NAMES", ()):
        pytest.skip(f"backend {name!r} is not registered")
    reasons = backends.get_backend(name).reasons(backends.BackendRequest.from_tensors(q, k))
    if reasons:
        pytest.skip(f"backend {name!r} cannot run here: {'; '.join(reasons)}")


MODULE_CONFIGS = [
    # (B, grid, Hq, Hkv, D, segment_lengths, dilation_rates)
    pytest.param(2, (6, 7), 4, 2, 8, [8, 16], [1, 2], id="6x7-gqa"),
    pytest.param(1, (5, 9), 4, 4, 16, [4, 12, 45], [1, 2, 4], id="5x9-three-branches"),
]


@pytest.mark.parametrize("backend", MODULE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,grid,Hq,Hkv,D,segs,rates", MODULE_CONFIGS)
def test_dilated_attention_module_hilbert_matches_reference(
    B, grid, Hq, Hkv, D, segs, rates, is_causal, dtype, backend
):
    modules = modules_or_skip()
    N = grid[0] * grid[1]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype)
    runnable_backend_or_skip(backend, q, k)
    module = modules.DilatedAttention(segs, rates, attention_backend=backend, ordering="hilbert", grid=grid)
    out = module(q, k, v, is_causal=is_causal)
    assert backend in module.selected_backends, module.selected_backends
    assert out.shape == q.shape and out.dtype == dtype

    perm, inv = hilbert_permutation(*grid)
    ref_out, _ = reference_in_curve_order(q, k, v, perm, inv, segs, rates, is_causal)
    plain_out, _ = reference_in_curve_order(q, k, v, perm, inv, segs, rates, is_causal, dtype=dtype)
    assert_within_rule("out", out, ref_out, plain_out, dtype)

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * dout).sum(), (q, k, v))
    plain = torch.autograd.grad((plain_out.double() * dout).sum(), (q, k, v))
    for name, a, e, p in zip(("dq", "dk", "dv"), got, want, plain, strict=True):
        assert_within_rule(name, a, e, p, dtype)


@pytest.mark.parametrize("backend", MODULE_BACKENDS)
def test_multihead_module_hilbert_matches_reference(backend):
    modules = modules_or_skip()
    torch.manual_seed(0)
    grid, E, heads, segs, rates = (7, 5), 32, 4, [8, 20], [1, 2]
    B, N = 2, grid[0] * grid[1]
    mha = modules.MultiheadDilatedAttention(
        E, heads, segs, rates, dtype=torch.float64, attention_backend=backend, ordering="hilbert", grid=grid
    )
    x = torch.randn(B, N, E, dtype=torch.float64, requires_grad=True)
    probe = x.detach().view(B, N, heads, E // heads)
    runnable_backend_or_skip(backend, probe, probe)
    out, weights = mha(x)
    assert weights is None and out.shape == x.shape
    assert backend in mha.attention.selected_backends, mha.attention.selected_backends

    # The same layer written out by hand around the reference, on pre-permuted heads.
    perm, inv = hilbert_permutation(*grid)
    q, k, v = (proj(x).view(B, N, heads, E // heads) for proj in (mha.q_proj, mha.k_proj, mha.v_proj))
    attn, _ = reference_in_curve_order(q, k, v, perm, inv, segs, rates, is_causal=False)
    attn = attn.reshape(B, N, E)
    if mha.norm is not None:
        attn = torch.nn.functional.layer_norm(attn, (E,), mha.norm.weight, mha.norm.bias, mha.norm.eps)
    expected = mha.out_proj(attn)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)

    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = (x, mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight)
    got = torch.autograd.grad((out * dout).sum(), params)
    want = torch.autograd.grad((expected * dout).sum(), params)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


def test_modules_reject_a_length_that_does_not_match_the_grid():
    modules = modules_or_skip()
    module = modules.DilatedAttention([8], [1], ordering="hilbert", grid=(4, 5))
    q = torch.randn(1, 21, 2, 8)
    with pytest.raises(ValueError, match=r"height=4, width=5.*20.*21"):
        module(q, q, q)
    mha = modules.MultiheadDilatedAttention(16, 2, [8], [1], ordering="hilbert", grid=(4, 5))
    with pytest.raises(ValueError, match=r"height=4, width=5.*20.*21"):
        mha(torch.randn(1, 21, 16))
