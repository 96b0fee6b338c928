"""Dilated attention over an image in Hilbert-curve token order.

An image (B, C, H, W) becomes H * W tokens. In row-major order a segment of w tokens is a strip of
rows; along a Hilbert curve it is a compact patch. This script prints how compact the segments
are in both orders (mean distance in pixels from a token to its segment's centre), runs dilated
attention in curve order, puts the result back into image layout, and can draw the curve.

    python examples/hilbert_image.py                      # 48 x 40 image, a few seconds on a CPU
    python examples/hilbert_image.py --height 37 --width 53 --plot hilbert.png
"""

from __future__ import annotations

import argparse
import time

import torch

from dilated_attention import dilated_attention
from dilated_attention.hilbert import from_curve_order, hilbert_permutation, segment_locality, to_curve_order


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--width", type=int, default=40)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--segment-lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--plot", default=None, help="write a picture of the curve and its first segments to this PNG"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.channels % args.heads:
        raise SystemExit(f"--channels {args.channels} must be a multiple of --heads {args.heads}")
    torch.manual_seed(args.seed)
    B, C, H, W = args.batch, args.channels, args.height, args.width
    N, D = H * W, C // args.heads

    image = torch.randn(B, C, H, W)  # (B, C, H, W)
    tokens = image.flatten(2).transpose(1, 2)  # (B, N, C), row-major: token row * W + col

    start = time.perf_counter()
    perm, inv = hilbert_permutation(H, W)
    print(f"Hilbert curve for {H} x {W} = {N} tokens in {1e3 * (time.perf_counter() - start):.1f} ms")

    print("\nmean distance (pixels) from a token to the centre of its segment:")
    print(f"{'segment':>8} {'rate':>5} {'row-major':>10} {'hilbert':>8}")
    for w, r in zip(args.segment_lengths, args.dilation_rates, strict=True):
        rm = segment_locality(torch.arange(N), H, W, w)
        hc = segment_locality(perm, H, W, w)
        print(f"{w:>8} {r:>5} {rm:>10.2f} {hc:>8.2f}")

    # Project to q, k, v (a random linear layer stands in for a trained one).
    qkv = torch.nn.Linear(C, 3 * C)
    with torch.no_grad():
        q, k, v = qkv(tokens).view(B, N, 3, args.heads, D).unbind(2)  # each (B, N, heads, D)
        start = time.perf_counter()
        q, k, v = (to_curve_order(t, perm) for t in (q, k, v))  # curve order along N
        out = dilated_attention(q, k, v, args.segment_lengths, args.dilation_rates)  # (B, N, heads, D)
        out = from_curve_order(out, inv)  # back to row-major
        elapsed = time.perf_counter() - start
    result = out.reshape(B, H, W, C).permute(0, 3, 1, 2)  # (B, C, H, W)
    print(
        f"\nattention in curve order: {tuple(image.shape)} -> {tuple(result.shape)} in {1e3 * elapsed:.1f} ms"
    )

    if args.plot:
        plot(perm, H, W, args.segment_lengths[0], args.plot)
        print(f"wrote {args.plot}")


def plot(perm: torch.Tensor, height: int, width: int, segment_length: int, path: str) -> None:
    """Draws the curve through the pixel centres, coloured by segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = (perm // width).numpy(), (perm % width).numpy()
    segment = torch.arange(height * width).numpy() // segment_length
    fig, ax = plt.subplots(figsize=(6, 6 * height / width + 0.5))
    ax.plot(cols, rows, color="0.6", linewidth=0.8)
    ax.scatter(cols, rows, c=segment % 20, cmap="tab20", s=12)
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(height - 0.5, -0.5)
    ax.set_aspect("equal")
    ax.set_title(f"Hilbert order on {height} x {width}, segments of {segment_length} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
