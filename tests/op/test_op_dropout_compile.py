"""Attention dropout in the native kernels under ``torch.compile(fullgraph=True)``: the seed and
offset the kernels' generator takes are drawn inside the graph (SymInt arguments of the ops), so
there is no graph break, every call draws a new mask, ``torch.manual_seed`` reproduces one, and the
backward regenerates the forward's mask."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs

from dilated_attention import DilatedAttention
from dilated_attention import dilated_attention as dattn
from dilated_attention import dilated_attention_varlen as dattn_varlen

SEGS, RATES, P = [8, 16], [1, 2], 0.3


def _fixed(q, k, v):
    return dattn(q, k, v, SEGS, RATES, is_causal=True, dropout_p=P, backend="native")


_MODULE = DilatedAttention(SEGS, RATES, attention_dropout=P, attention_backend="native")


def _padded(q, k, v):
    mask = torch.ones(q.shape[:2], dtype=torch.bool)
    mask[1, 20:] = False
    return _MODULE(q, k, v, is_causal=True, key_padding_mask=mask)


def _packed(q, k, v):
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    flat = (t.flatten(0, 1) for t in (q, k, v))
    return dattn_varlen(*flat, cu, 44, SEGS, RATES, is_causal=True, dropout_p=P, backend="native")


@pytest.mark.parametrize("fn", [_fixed, _padded, _packed], ids=["fixed", "key_padding_mask", "packed"])
def test_dropout_compiles_without_graph_break(fn):
    torch._dynamo.reset()
    q, k, v = make_inputs(2, 32, 4, 2, 8, torch.float64, seed=1)
    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(5)
    a = compiled(q, k, v)
    torch.manual_seed(5)
    b = compiled(q, k, v)
    c = compiled(q, k, v)
    assert torch.equal(a, b)  # reproducible under torch.manual_seed
    assert not torch.equal(a, c)  # a new mask every call
    # out is linear in v (out = (P * M / (1 - p)) v): with the forward's mask in the backward,
    # sum(dv * v) equals the loss sum(w * out) exactly; another mask would not.
    w = torch.randn_like(c)
    (c * w).sum().backward()
    torch.testing.assert_close((v.grad * v).sum(), (c * w).sum(), rtol=1e-12, atol=1e-12)
    # and it is dropout: far from the same call without it
    without = dattn(q.detach(), k.detach(), v.detach(), SEGS, RATES, is_causal=True, backend="native")
    if fn is _packed:
        return
    assert (c.detach() - without).abs().max() > 0.1
