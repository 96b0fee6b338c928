"""The transformers integration (dilated_attention.transformers) with GPT-2 and Llama models built
from tiny configs (no downloads): the attention against the float64 reference on the model's own
q/k/v, whole models against SDPA where the two compute the same attention, padding (left and
right) against each row run alone, generation with the cache against generation without it, a
few training steps, and the patterns it refuses. Skipped when transformers is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from common import one_thread  # noqa: E402, F401  (after the skip; one_thread: an autouse fixture)
from reference import reference_attention  # noqa: E402  (after the skip)
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

import dilated_attention.transformers as dt  # noqa: E402
from dilated_attention import dilated_attention  # noqa: E402

BRANCHES = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4]}
V = 48


def gpt2(branches=BRANCHES, attn="dilated_attention"):
    cfg = GPT2Config(
        vocab_size=V,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
        dilated_attention=branches,
    )
    return cfg, attn


def llama(branches=BRANCHES, attn="dilated_attention"):
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dilated_attention=branches,
    )
    return cfg, attn


MODELS = [pytest.param(gpt2, id="gpt2"), pytest.param(llama, id="llama")]


def build(factory, seed=0, dtype=torch.float64, **kw):
    cfg, attn = factory(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.to(dtype).eval()


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a padded batch: each row's real tokens from 0 (what generate() passes)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("factory", MODELS)
def test_attention_equals_the_reference_on_the_models_qkv(factory, monkeypatch):
    """Inside a real forward, the registered function's output on the model's own q/k/v equals the
    float64 reference (causal, GQA, the model's scaling) and the functional API."""
    seen = []

    def spy(module, query, key, value, attention_mask, **kw):
        out, w = dt.dilated_attention_forward(module, query, key, value, attention_mask, **kw)
        seen.append((query, key, value, kw.get("scaling"), out))
        return out, w

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, dt.NAME, spy)
    model = build(factory)
    model(torch.randint(0, V, (2, 21)))
    assert len(seen) == 2  # one call per layer
    segs, rates = BRANCHES["segment_lengths"], BRANCHES["dilation_rates"]
    for query, key, value, scaling, out in seen:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, H, D)
        assert k.shape[2] < q.shape[2] or factory is gpt2  # Llama runs grouped-query attention
        ref, _ = reference_attention(q, k, v, segs, rates, is_causal=True, softmax_scale=scaling)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        api = dilated_attention(q, k, v, segs, rates, is_causal=True, softmax_scale=scaling)
        torch.testing.assert_close(out, api, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "causal,side", [(True, "right"), (True, "left"), (False, "right"), (True, "mixed")], ids=str
)
def test_padded_attention_against_the_reference(causal, side):
    """padded_attention (SPEC section 7): every row's real run equals the float64 reference of
    that run alone, forward and backward; padded positions give 0 and zero gradients."""
    from common import make_inputs

    segs, rates = [4, 8, 16], [1, 2, 4]
    B, N = 3, 19
    q, k, v = make_inputs(B, N, 4, 2, 8, torch.float64, seed=5)
    lengths = [19, 7, 12]
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if side == "left" or (side == "mixed" and b == 1):
            mask[b, N - n :] = True
        else:
            mask[b, :n] = True
    out = dt.padded_attention(
        q, k, v, mask, segs, rates, is_causal=causal, softmax_scale=None, dropout_p=0.0, backend="auto"
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    for g in grads:
        assert torch.equal(g[~mask], torch.zeros_like(g[~mask]))
    for b in range(B):
        real = mask[b]
        rq, rk, rv = (t[b : b + 1, real].detach().requires_grad_() for t in (q, k, v))
        ref, _ = reference_attention(rq, rk, rv, segs, rates, is_causal=causal)
        torch.testing.assert_close(out[b, real], ref[0], rtol=1e-10, atol=1e-10)
        ref_grads = torch.autograd.grad((ref * dout[b : b + 1, real]).sum(), (rq, rk, rv))
        for g, rg in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g[b, real], rg[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("factory", MODELS)
def test_one_dense_branch_equals_sdpa(factory):
    """One branch that covers the whole sequence (w >= N, r = 1) is dense causal attention: the
    whole model then equals the same weights under transformers' own SDPA."""
    dense = {"segment_lengths": [64], "dilation_rates": [1]}
    a = build(factory, branches=dense)
    b = build(factory, branches=dense, attn="sdpa")
    x = torch.randint(0, V, (2, 19))
    torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-9, atol=1e-9)
    # And the branches matter: the default dilated pattern gives other logits.
    c = build(factory)
    assert (c(x).logits - b(x).logits).abs().max() > 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("factory", MODELS)
def test_padded_batch_equals_rows_alone(factory, side, monkeypatch):
    """A padded batch: every row's real tokens give the logits of that row run alone; the mask
    goes through our mask function and changes the result (it is not dropped)."""
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("attention_mask"))
        return dt.dilated_attention_mask(*args, **kw)

    monkeypatch.setitem(transformers.masking_utils.AttentionMaskInterface._global_mapping, dt.NAME, spy)
    model = build(factory)
    lengths = [21, 9, 14]
    N = max(lengths)
    x = torch.randint(1, V, (3, N))
    mask = torch.zeros(3, N, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, N - n :] = 1
        else:
            mask[b, :n] = 1
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=positions(mask)).logits
        unmasked = model(x, position_ids=positions(mask)).logits
        for b in range(len(lengths)):
            real = mask[b].bool()
            alone = model(x[b : b + 1, real]).logits[0]
            torch.testing.assert_close(out[b, real], alone, rtol=1e-9, atol=1e-9)
    assert calls and calls[0] is not None
    if side == "left":  # (causal attention never lets a real token see right padding)
        assert (out[1, mask[1].bool()] - unmasked[1, mask[1].bool()]).abs().max() > 1e-4


@pytest.mark.parametrize("factory", MODELS)
def test_generate_with_cache_equals_without(factory, monkeypatch):
    """Greedy generation of a left-padded batch: with the cache (decode steps through
    dilated_attention_decode) the tokens and every step's logits equal those without the cache
    (a full forward per step); the padded row also equals its own generation alone."""
    decode_calls = []

    def spy(*args, **kw):
        decode_calls.append(kw.get("cache_leftpad"))
        return decode(*args, **kw)

    decode = dt.attention.dilated_attention_decode
    monkeypatch.setattr(dt.attention, "dilated_attention_decode", spy)
    model = build(factory)
    x = torch.randint(1, V, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    kw["output_scores"] = True
    with torch.no_grad():
        a = model.generate(x, attention_mask=mask, use_cache=True, **kw)
        b = model.generate(x, attention_mask=mask, use_cache=False, **kw)
        alone = model.generate(x[1:, 4:], use_cache=True, **kw)
    assert len(decode_calls) == 2 * (11 + 11)  # 11 steps after the prefill, 2 layers, 2 runs with cache
    assert decode_calls[0].tolist() == [0, 4]  # the padded row's keys start after its padding
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=1e-9, atol=1e-9)
    assert torch.equal(a.sequences[1, 11:], alone.sequences[0, 7:])
    torch.testing.assert_close(
        torch.stack(a.scores)[:, 1], torch.stack(alone.scores)[:, 0], rtol=1e-9, atol=1e-9
    )


def test_static_cache_generation_equals_dynamic():
    """A static cache holds more slots than are in use: the mask function says how many are."""
    model = build(llama)
    x = torch.randint(1, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    kw["output_scores"] = True
    with torch.no_grad():
        a = model.generate(x, attention_mask=mask, **kw)
        b = model.generate(x, attention_mask=mask, cache_implementation="static", **kw)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=1e-9, atol=1e-9)


def test_bidirectional_encoder_with_padding():
    """BERT (bidirectional): a right-padded row equals the row alone, and the padding is masked."""
    cfg = transformers.BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        dilated_attention=BRANCHES,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    with pytest.warns(dt.DenseWeightsWarning):  # switched from SDPA: its function changes
        model.set_attn_implementation(dt.NAME)
    model = model.double().eval()
    x = torch.randint(1, V, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, 8:] = 0
    with torch.no_grad():
        out = model(x, attention_mask=mask).last_hidden_state
        alone = model(x[:1, :8]).last_hidden_state
        unmasked = model(x).last_hidden_state
    torch.testing.assert_close(out[0, :8], alone[0], rtol=1e-9, atol=1e-9)
    assert (out[0, :8] - unmasked[0, :8]).abs().max() > 1e-4


@pytest.mark.parametrize("factory", MODELS)
def test_training_steps_lower_the_loss(factory):
    model = build(factory, dtype=torch.float32).train()
    x = torch.randint(0, V, (4, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_what_it_cannot_honour_is_an_error():
    model = build(gpt2)
    x = torch.randint(1, V, (2, 8))
    holes = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1] * 8])
    with pytest.raises(ValueError, match=r"row 0 is not one contiguous run .* row 0 starts 11011111"):
        model(x, attention_mask=holes)
    with pytest.raises(ValueError, match="4-D"):
        model(x, attention_mask=torch.zeros(2, 1, 8, 8))
    # A sliding-window model: its mask pattern is refused, not dropped.
    cfg = transformers.MistralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    mistral = AutoModelForCausalLM.from_config(cfg, attn_implementation=dt.NAME)
    with pytest.raises(ValueError, match="sliding"):
        mistral(x)
    with pytest.raises(ValueError, match=r"unknown keys \['segments'\]"):
        build(gpt2, branches={"segments": [4]})(x)
    with pytest.raises(ValueError, match="dilation_rates"):
        build(gpt2, branches={"segment_lengths": [4], "dilation_rates": [8]})(x)


def test_settings_default_and_config():
    assert dt.settings(None) == (
        dt.DEFAULT_CONFIG["segment_lengths"],
        dt.DEFAULT_CONFIG["dilation_rates"],
        "auto",
    )
    cfg, _ = gpt2(branches={"segment_lengths": [8], "dilation_rates": [2], "backend": "sdpa"})
    assert dt.settings(cfg) == ([8], [2], "sdpa")
    with pytest.raises(TypeError, match="must be a dict"):
        dt.settings(type("C", (), {"dilated_attention": [8]})())
    with pytest.raises(ValueError, match="'cross_attention'\\] must be 'refuse' or 'dense', got 'maybe'"):
        dt.settings(type("C", (), {"dilated_attention": {"cross_attention": "maybe"}})())


@pytest.mark.parametrize("name", ["sdpa", "eager", "flash_attention_2", "", None, 3])
def test_register_refuses_transformers_own_names_and_non_names(name):
    """Registering over "sdpa" made every model that asks for sdpa run dilated attention."""
    with pytest.raises(ValueError, match="register: "):
        dt.register(name)
    assert dt.register("dilated_attention_again") == "dilated_attention_again"


def test_the_package_imports_without_transformers():
    code = "import sys, dilated_attention; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tested_range_is_declared_everywhere():
    """pyproject.toml's extra and the Makefile's CI install pin the range the module says it is
    tested with (another installed version gets a warning on import)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pin = f'"transformers{dt.TESTED_VERSIONS}"'
    assert f"transformers = [{pin}]" in (root / "pyproject.toml").read_text()
    assert f"TRANSFORMERS_SPEC ?= transformers{dt.TESTED_VERSIONS}" in (root / "Makefile").read_text()


def test_readme_snippet_runs():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("## Use it in a transformers model")
    code = readme[
        readme.index("```python\n", start) + 10 : readme.index("```\n", readme.index("```python\n", start))
    ]
    exec(compile(code, "README.md", "exec"), {})


def test_a_sliding_window_model_is_refused_naming_its_window():
    """The refusal names the mask transformers composes, with its values (a Mistral or Gemma 2
    layer's sliding_window), not only the closure's name."""
    from transformers import masking_utils

    fn = masking_utils.sliding_window_causal_mask_function(8)
    with pytest.raises(ValueError, match=r"sliding_window_overlay\(sliding_window=8\), causal_mask_function"):
        dt.dilated_attention_mask(batch_size=1, q_length=4, kv_length=4, mask_function=fn)
