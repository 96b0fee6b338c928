"""The example GPT's ``sample.py`` with the bounded cache: the same tokens as ``GPT.generate`` on
the full cache (the same sampling generator), past the block size where the cache is rebuilt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from common import one_thread  # noqa: F401  (one_thread: an autouse fixture)

GPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(GPT_DIR))

import sample  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


@pytest.mark.parametrize("backend,n_kv_head", [("native", 2), ("dense", 4)])
def test_bounded_sampling_equals_the_full_cache(backend, n_kv_head):
    cfg = GPTConfig(
        block_size=40, vocab_size=64, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, dropout=0.0,
        attention_backend=backend, segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4),
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).to(torch.float64).eval()
    x = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        full = model.generate(x, 50, top_k=10, generator=torch.Generator().manual_seed(3))
        bounded = sample.generate_bounded(model, x, 50, 1.0, 10, torch.Generator().manual_seed(3))
    assert torch.equal(full, bounded)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        sample.generate_bounded(model, x, 1, 0, None, torch.Generator())
