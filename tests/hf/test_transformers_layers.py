"""The transformers integration refuses what it cannot compute: cross-attention (BART, GPT-2 and
BERT with add_cross_attention) by the layer's name, model classes whose attention layers bypass the
attention interface (BLOOM, CodeGen, XGLM, Falcon, GPT-J, GPT-Neo, MPT) by the class's name; a
model's position bias is named in short; a model with dense-trained weights switched to dilated
attention gets a warning. Tiny configs, random weights, no downloads."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from common import one_thread  # noqa: E402, F401  (after the skip; one_thread: an autouse fixture)

import dilated_attention.transformers as dt  # noqa: E402

V = 48
DENSE = {"segment_lengths": [64], "dilation_rates": [1]}


def bart_config(**kw):
    return transformers.BartConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dilated_attention=DENSE,
        **kw,
    )


def built(cls, cfg, attn, seed=0):
    """The model on a copy of ``cfg`` (transformers sets the implementation on the config it is
    given, which a second model built from it would change under the first)."""
    torch.manual_seed(seed)
    return cls._from_config(copy.deepcopy(cfg), attn_implementation=attn).double().eval()


@pytest.mark.parametrize("dec_len", [7, 10, 13], ids=lambda n: f"dec{n}")
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_bart_cross_attention_is_refused_naming_the_layer(dec_len, padded):
    """BART's decoder attends to the encoder's output. Dilated attention is defined over one
    sequence: every forward (shorter, equal and longer decoder input; with and without the
    encoder's padding mask) and generate() raise, naming the cross-attention layer, instead of
    returning logits off by up to 8 (the keys cut to the query length, the encoder's mask packing
    the decoder's rows)."""
    model = built(transformers.BartForConditionalGeneration, bart_config(), dt.NAME)
    x = torch.randint(3, V, (2, 10))
    y = torch.randint(3, V, (2, dec_len))
    mask = torch.ones(2, 10, dtype=torch.long)
    if padded:
        mask[1, 6:] = 0
    with pytest.raises(ValueError, match=r"cross-attention of BartAttention \(layer_idx=0\)"):
        model(input_ids=x, attention_mask=mask, decoder_input_ids=y)
    with pytest.raises(ValueError, match=r"cross-attention of BartAttention"):
        model.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)


def test_bart_as_a_decoder_only_model_runs():
    """BartForCausalLM without encoder states is self-attention only: it runs, and one dense branch
    equals transformers' SDPA on the same weights (no cross-attention refused by mistake); given
    encoder states, its cross-attention is refused."""
    cfg = bart_config(is_decoder=True, is_encoder_decoder=False)
    a = built(transformers.BartForCausalLM, cfg, dt.NAME)
    b = built(transformers.BartForCausalLM, cfg, "sdpa")
    x = torch.randint(3, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-9, atol=1e-9)
    states = torch.randn(2, 12, 32, dtype=torch.float64)  # as long as the decoder input
    with pytest.raises(ValueError, match="cross-attention of BartAttention"):
        a(x, encoder_hidden_states=states)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_cross_attention_layers_are_refused(arch):
    """GPT-2 and BERT decoders with add_cross_attention: the cross-attention layer (marked by
    is_cross_attention, or a cross-attention class) is refused even when the encoder states are
    as long as the decoder input; without encoder states the model runs and equals SDPA."""
    if arch == "gpt2":
        cls = transformers.GPT2LMHeadModel
        cfg = transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64, add_cross_attention=True
        )
        layer = r"GPT2Attention \(layer_idx=0\)"
    else:
        cls = transformers.BertLMHeadModel
        cfg = transformers.BertConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            is_decoder=True,
            add_cross_attention=True,
        )
        layer = r"BertCrossAttention \(layer_idx=0\)"
    cfg.dilated_attention = DENSE
    a, b = built(cls, cfg, dt.NAME), built(cls, cfg, "sdpa")
    x = torch.randint(3, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=1e-9, atol=1e-9)
    for n in (9, 5):
        states = torch.randn(2, n, 32, dtype=torch.float64)
        with pytest.raises(ValueError, match=f"cross-attention of {layer}"):
            a(x, encoder_hidden_states=states)


def test_the_cross_attention_mask_covers_the_keys():
    """The mask function sizes a cross-attention padding mask by the keys (the encoder's length),
    not by the queries."""
    enc = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    mask = dt.dilated_attention_mask(
        2, 7, 10, mask_function=transformers.masking_utils.bidirectional_mask_function, attention_mask=enc
    )
    assert mask is not None and mask.shape == (2, 10) and mask.tolist() == enc.bool().tolist()


def test_position_bias_is_named_in_short():
    """T5 passes a position bias: the refusal names it by shape, not by printing the tensor."""
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    cfg.dilated_attention = DENSE
    try:
        model = built(transformers.T5EncoderModel, cfg, dt.NAME)
    except ValueError as exc:  # releases before 5.5 run T5's attention without the interface
        assert "T5Attention" in str(exc)
        pytest.skip("T5's attention does not dispatch through the interface in this release")
    with pytest.raises(ValueError) as info:
        model(torch.randint(3, V, (2, 10)))
    message = str(info.value)
    assert "position_bias=<tensor of shape (1, 4, 10, 10), float64>" in message, message
    assert len(message) < 200 and "tensor([" not in message


def test_describe():
    assert dt.describe(torch.zeros(2, 3)) == "<tensor of shape (2, 3), float32>"
    assert dt.describe(4) == "4"
    assert dt.describe("x" * 200).endswith("...") and len(dt.describe("x" * 200)) == 80


def gpt2_config(branches=None):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None
    )
    if branches is not None:
        cfg.dilated_attention = branches
    return cfg


def test_switching_dense_weights_warns_once_at_the_users_line():
    """set_attn_implementation on a model built for SDPA changes its function (the logits move,
    unlike eager/sdpa switches): one DenseWeightsWarning, naming the branches, at this file's line;
    a second model of the same type and branches does not warn again."""
    x = torch.randint(0, V, (2, 24))
    model = built(transformers.GPT2LMHeadModel, gpt2_config(), "sdpa")
    with torch.no_grad():
        dense = model(x).logits
    with pytest.warns(dt.DenseWeightsWarning) as record:
        model.set_attn_implementation(dt.NAME)
    assert len(record) == 1
    message = str(record[0].message)
    assert "segment_lengths=[2048, 4096, 8192, 16384, 32768]" in message and "'sdpa'" in message
    assert record[0].filename == __file__
    with torch.no_grad():
        assert (model(x).logits - dense).abs().max() > 1e-3  # what the warning is about
    other = built(transformers.GPT2LMHeadModel, gpt2_config(), "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dt.DenseWeightsWarning)
        other.set_attn_implementation(dt.NAME)


def test_dense_branches_and_models_built_for_dilated_attention_do_not_warn():
    """One branch covering every position (w >= max_position_embeddings, r = 1) keeps the function:
    no warning, and the logits equal SDPA's; a model built with dilated attention does not warn."""
    x = torch.randint(0, V, (2, 24))
    with warnings.catch_warnings():
        warnings.simplefilter("error", dt.DenseWeightsWarning)
        model = built(transformers.GPT2LMHeadModel, gpt2_config(DENSE), "sdpa")
        with torch.no_grad():
            dense = model(x).logits
        model.set_attn_implementation(dt.NAME)
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, dense, rtol=1e-9, atol=1e-9)
        built(transformers.GPT2LMHeadModel, gpt2_config(), dt.NAME)


def test_loading_a_dense_checkpoint_warns(tmp_path):
    """from_pretrained of a checkpoint saved without branches warns; one saved with them does not."""
    built(transformers.GPT2LMHeadModel, gpt2_config(), "sdpa").save_pretrained(tmp_path / "dense")
    with pytest.warns(dt.DenseWeightsWarning, match="loading its checkpoint"):
        transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "dense", attn_implementation=dt.NAME)
    cfg = gpt2_config({"segment_lengths": [8, 16], "dilation_rates": [1, 2]})
    built(transformers.GPT2LMHeadModel, cfg, dt.NAME).save_pretrained(tmp_path / "dilated")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dt.DenseWeightsWarning)
        transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "dilated", attn_implementation=dt.NAME)


@pytest.mark.parametrize(
    "arch,layer",
    [("bloom", "BloomAttention"), ("xglm", "XGLMAttention")],
)
def test_models_that_bypass_the_interface_are_refused_by_name(arch, layer):
    """BLOOM and XGLM run their own dense attention whatever the implementation is: built with or
    switched to dilated attention, they are refused naming the class and its layer. (CodeGen and
    GPT-J did too up to transformers 5.23; tests/hf/test_transformers_models.py checks every
    architecture against what it does in the installed release.)"""
    cfg = transformers.AutoConfig.for_model(
        arch, vocab_size=V, hidden_size=32, n_embd=32, d_model=32, num_layers=1, n_layer=1, n_head=4
    )
    cfg.num_attention_heads = 4
    with pytest.raises(ValueError, match=f"cannot run attn_implementation='dilated_attention'.*{layer}"):
        transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=dt.NAME)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    with pytest.raises(ValueError, match=rf"ForCausalLM \(model type '{arch}'\) cannot run.*{layer}"):
        model.set_attn_implementation(dt.NAME)


def test_the_mask_function_takes_the_cache_position_of_older_releases():
    """transformers 5.0-5.3 call the mask function with the queries' cache_position instead of
    q_length/q_offset: both give the same mask."""
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10])
    for q_offset, q_length in [(0, 10), (7, 3), (9, 1)]:
        new = dt.dilated_attention_mask(2, q_length, 10, q_offset=q_offset, attention_mask=pad)
        old = dt.dilated_attention_mask(
            2, kv_length=10, cache_position=torch.arange(q_offset, q_offset + q_length), attention_mask=pad
        )
        assert new is not None and old is not None and torch.equal(new, old)
    with pytest.raises(TypeError, match="q_length"):
        dt.dilated_attention_mask(2, kv_length=10)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_dense_cross_attention_when_opted_in_equals_sdpa(padded):
    """config.dilated_attention['cross_attention'] = 'dense': BART's cross-attention layers run
    dense. With one dense branch for the self-attention too, the whole model equals transformers'
    SDPA on the same weights: forward (decoder shorter, as long as and longer than the encoder
    input) and greedy generate() with its cache."""
    branches = {**DENSE, "cross_attention": "dense"}
    cfg = bart_config()
    cfg.dilated_attention = branches
    a = built(transformers.BartForConditionalGeneration, cfg, dt.NAME)
    b = built(transformers.BartForConditionalGeneration, cfg, "sdpa")
    x = torch.randint(3, V, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    if padded:
        mask[1, 6:] = 0
    with torch.no_grad():
        for n in (7, 10, 13):
            y = torch.randint(3, V, (2, n))
            out = a(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
            ref = b(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
            torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
        kw = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
        ga = a.generate(x, attention_mask=mask, **kw)
        gb = b.generate(x, attention_mask=mask, **kw)
    assert torch.equal(ga.sequences, gb.sequences)
    torch.testing.assert_close(torch.stack(ga.scores), torch.stack(gb.scores), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="'refuse' or 'dense', got 'sparse'"):
        dt.cross_attention_mode(type("C", (), {"dilated_attention": {"cross_attention": "sparse"}})())


def _attention_free_config(arch: str):
    if arch == "mamba":
        return transformers.MambaConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2
        )
    return transformers.RwkvConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        attention_hidden_size=32,
        intermediate_size=64,
        context_length=32,
    )


@pytest.mark.parametrize("arch,cls", [("mamba", "MambaForCausalLM"), ("rwkv", "RwkvForCausalLM")])
def test_models_without_attention_layers_are_refused_by_name(arch, cls, monkeypatch):
    """Mamba and RWKV compute no attention: an attention implementation changes nothing in them
    (no layer ever calls it, as a function registered under another name shows). Built with or
    switched to dilated attention, they are refused naming the class, as models whose layers
    bypass the interface are."""
    cfg = _attention_free_config(arch)
    match = rf"{cls} \(model type '{arch}'\) cannot run attn_implementation='dilated_attention': it has no attention layer"
    with pytest.raises(ValueError, match=match):
        transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=dt.NAME)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    with pytest.raises(
        ValueError, match=r"ForCausalLM \(model type '" + arch + r"'\) cannot run.*no attention layer"
    ):
        model.set_attn_implementation(dt.NAME)
    assert model.config._attn_implementation != dt.NAME
    calls: list = []
    sdpa = transformers.AttentionInterface._global_mapping["sdpa"]
    probe = "dilated_attention_test_attention_free"
    monkeypatch.setitem(
        transformers.AttentionInterface._global_mapping,
        probe,
        lambda *a, **k: calls.append(1) or sdpa(*a, **k),
    )
    monkeypatch.setitem(
        transformers.masking_utils.AttentionMaskInterface._global_mapping,
        probe,
        transformers.masking_utils.AttentionMaskInterface._global_mapping["sdpa"],
    )
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=probe)
    with torch.no_grad():
        other(torch.randint(0, V, (1, 8)))
    assert not calls  # what the refusal is about: no layer would call the registered function


DILATED = {"segment_lengths": [4, 8], "dilation_rates": [1, 2]}


def bigbird_pegasus_decoder_config(branches: dict) -> Any:
    """BigBirdPegasus as a decoder alone: its self-attention layers are built ``is_decoder=True,
    is_causal=False`` and take their causality from the mask."""
    return transformers.BigBirdPegasusConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        attention_type="original_full",
        is_decoder=True,
        is_encoder_decoder=False,
        dilated_attention=branches,
    )


def nllb_moe_config(branches: dict) -> Any:
    """NLLB-MoE: its decoder's self-attention and cross-attention layers are both built
    ``is_decoder=True, is_causal=False``; only the call's arguments tell them apart."""
    return transformers.NllbMoeConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        num_experts=4,
        expert_capacity=8,
        dilated_attention=branches,
    )


@pytest.fixture
def paths(monkeypatch):
    """Records which path each attention call took: ("dilated", is_causal) for a whole-sequence
    call, ("decode",) for a cached step, ("dense", is_causal) for the dense fallback."""
    seen: list = []
    at = dt.attention  # the module whose globals the attention function calls
    dilated, decode, dense = at.dilated_attention, at.dilated_attention_decode, at.dense_cross_attention

    def spy_dilated(*args, **kwargs):
        seen.append(("dilated", kwargs["is_causal"]))
        return dilated(*args, **kwargs)

    def spy_decode(*args, **kwargs):
        seen.append(("decode",))
        return decode(*args, **kwargs)

    def spy_dense(*args, **kwargs):
        seen.append(("dense", kwargs.get("is_causal", False)))
        return dense(*args, **kwargs)

    monkeypatch.setattr(at, "dilated_attention", spy_dilated)
    monkeypatch.setattr(at, "dilated_attention_decode", spy_decode)
    monkeypatch.setattr(at, "dense_cross_attention", spy_dense)
    return seen


def _last_token_changed(y: torch.Tensor) -> torch.Tensor:
    other = y.clone()
    other[:, -1] = (y[:, -1] + 1 - 3) % (V - 3) + 3
    return other


def test_bigbird_pegasus_decoder_self_attention_is_causal_and_dilated(paths):
    """BigBirdPegasus' decoder self-attention (is_decoder=True, is_causal=False, causal by its
    mask) was refused as cross-attention. It runs dilated and causal: changing the last token
    leaves every earlier position's logits as they were, and one dense branch equals eager."""
    model = built(transformers.BigBirdPegasusForCausalLM, bigbird_pegasus_decoder_config(DILATED), dt.NAME)
    y = torch.randint(3, V, (2, 12))
    with torch.no_grad():  # use_cache=False: this release's BigBirdPegasusForCausalLM fails with a cache
        a = model(y, use_cache=False).logits
        b = model(_last_token_changed(y), use_cache=False).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=0)
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-3
    assert paths and set(paths) == {("dilated", True)}
    cfg = bigbird_pegasus_decoder_config(DENSE)
    ours, eager = (
        built(transformers.BigBirdPegasusForCausalLM, cfg, dt.NAME),
        built(transformers.BigBirdPegasusForCausalLM, cfg, "eager"),
    )
    with torch.no_grad():
        torch.testing.assert_close(
            ours(y, use_cache=False).logits, eager(y, use_cache=False).logits, rtol=1e-9, atol=1e-9
        )


def test_nllb_moe_self_attention_is_dilated_and_cross_attention_refused(paths):
    """NLLB-MoE's decoder layers build their self- and cross-attention alike (is_decoder=True,
    is_causal=False). By default the cross-attention is refused by name (the call that was given
    key_value_states), after the self-attention of the same layer ran dilated and causal."""
    model = built(transformers.NllbMoeForConditionalGeneration, nllb_moe_config(DILATED), dt.NAME)
    x, y = torch.randint(3, V, (2, 10)), torch.randint(3, V, (2, 12))
    match = r"cross-attention of NllbMoeAttention \(layer_idx=0\) \(the call was given key_value_states"
    with pytest.raises(ValueError, match=match):
        model(input_ids=x, decoder_input_ids=y)
    assert ("dilated", True) in paths and not any(p[0] == "dense" for p in paths)


def test_nllb_moe_dense_cross_attention_keeps_the_self_attention_causal_and_dilated(paths):
    """With cross_attention='dense', NLLB-MoE's decoder self-attention ran dense and without its
    causal mask (positions 0-10 changed when only the last token did). Now it runs dilated and
    causal, the cross-attention dense: earlier logits stay put, and with one dense branch forward
    and greedy generate() (the cached decode steps) equal eager on the same weights."""
    cfg = nllb_moe_config({**DILATED, "cross_attention": "dense"})
    model = built(transformers.NllbMoeForConditionalGeneration, cfg, dt.NAME)
    x, y = torch.randint(3, V, (2, 10)), torch.randint(3, V, (2, 12))
    with torch.no_grad():
        a = model(input_ids=x, decoder_input_ids=y).logits
        b = model(input_ids=x, decoder_input_ids=_last_token_changed(y)).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=0)
    # Two forwards: the encoder's layer (bidirectional), the decoder's two self-attention layers
    # (dilated, causal) and its two cross-attention layers (dense).
    assert paths.count(("dilated", False)) == 2
    assert paths.count(("dilated", True)) == paths.count(("dense", False)) == 4
    assert len(paths) == 10
    cfg = nllb_moe_config({**DENSE, "cross_attention": "dense"})
    ours, eager = (
        built(transformers.NllbMoeForConditionalGeneration, cfg, impl) for impl in (dt.NAME, "eager")
    )
    kw = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    with torch.no_grad():
        out, ref = (
            ours(input_ids=x, decoder_input_ids=y).logits,
            eager(input_ids=x, decoder_input_ids=y).logits,
        )
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
        paths.clear()
        ga, gb = ours.generate(x, **kw), eager.generate(x, **kw)
    assert ("decode",) in paths
    assert torch.equal(ga.sequences, gb.sequences)
    torch.testing.assert_close(torch.stack(ga.scores), torch.stack(gb.scores), rtol=1e-9, atol=1e-9)


def test_a_decoder_layer_called_unseen_is_refused_whatever_the_mode():
    """A decoder's layer built is_decoder=True, is_causal=False whose call the integration did not
    see (the implementation set on the config by hand, bypassing the hooks that note where a call's
    keys come from) could be either kind of attention: it is refused, also with
    cross_attention='dense', saying how to build or switch the model instead."""
    cfg = nllb_moe_config({**DENSE, "cross_attention": "dense"})
    model = built(transformers.NllbMoeForConditionalGeneration, cfg, "eager")
    model.config._attn_implementation = dt.NAME
    x, y = torch.randint(3, V, (2, 10)), torch.randint(3, V, (2, 12))
    with pytest.raises(
        ValueError, match=r"cannot tell whether NllbMoeAttention \(layer_idx=0\).*set_attn_implementation"
    ):
        model(input_ids=x, decoder_input_ids=y)
    model.set_attn_implementation(dt.NAME)  # the same model switched through transformers runs
    with torch.no_grad():
        model(input_ids=x, decoder_input_ids=y)


def test_the_dense_fallback_keeps_a_causal_mask():
    """dense_cross_attention of a causal call reads, for query i of nq, the keys up to position
    nk - nq + i (queries after a cache), as SDPA's causal mask does for nq == nk."""
    from dilated_attention.transformers.layers import dense_cross_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, dtype=torch.float64) for n in (6, 6, 6))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(dense_cross_attention(q, k, v, None, None, 0.0, is_causal=True), want)
    got = dense_cross_attention(q[:, :, 4:], k, v, None, None, 0.0, is_causal=True)
    torch.testing.assert_close(got, want[:, 4:])
    with pytest.raises(ValueError, match="7 queries over 6 keys"):
        dense_cross_attention(
            torch.randn(2, 4, 7, 8, dtype=torch.float64), k, v, None, None, 0.0, is_causal=True
        )


def test_an_attention_free_part_of_a_composite_model_is_not_refused(monkeypatch):
    """A composite model with an attention-free part (here a Mamba model next to a GPT-2 decoder,
    as a vision-language model may hold a convolutional vision tower) is checked as a whole: the
    part, built inside the composite's constructor, is not refused on its own, while the same part
    built alone is."""
    from dilated_attention.transformers import dispatch

    mamba = _attention_free_config("mamba")

    class Composite(transformers.PreTrainedModel):
        config_class = transformers.GPT2Config
        _supports_attention_backend = True

        def __init__(self, config: transformers.GPT2Config) -> None:
            super().__init__(config)
            impl = config._attn_implementation
            self.recurrent = transformers.MambaModel._from_config(
                copy.deepcopy(mamba), attn_implementation=impl
            )
            self.decoder = transformers.GPT2Model._from_config(
                copy.deepcopy(config), attn_implementation=impl
            )
            self.post_init()

    cfg = gpt2_config(DENSE)
    model = Composite._from_config(copy.deepcopy(cfg), attn_implementation=dt.NAME)
    assert model.recurrent.config._attn_implementation == dt.NAME
    with pytest.raises(ValueError, match=r"MambaModel .*it has no attention layer"):
        transformers.MambaModel._from_config(copy.deepcopy(mamba), attn_implementation=dt.NAME)
    monkeypatch.setattr(dispatch, "_inside_another_model", lambda model: False)
    with pytest.raises(ValueError, match=r"MambaModel .*it has no attention layer"):
        Composite._from_config(copy.deepcopy(cfg), attn_implementation=dt.NAME)
