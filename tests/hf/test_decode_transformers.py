"""``dilated_attention.transformers_cache``: ``generate()`` of a tiny Llama on the bounded cache
equals generation on transformers' own cache token for token (greedy), for a left-padded batch;
its memory stays fixed; what it cannot do is refused by name. Skipped without transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from common import one_thread  # noqa: E402, F401  (after the skip; one_thread: an autouse fixture)
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import dilated_attention.decode.bounded as bounded_mod  # noqa: E402
import dilated_attention.transformers.cache as dtc  # noqa: E402

V = 48


def llama(attn="dilated_attention", dtype=torch.float64):
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dilated_attention={"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4]},
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype).eval()


def cache_kw(cache: dtc.BoundedDilatedCache) -> dict[str, dtc.BoundedDilatedCache]:
    """generate()'s (and the model's) cache argument, under the installed transformers' name."""
    return {dtc.GENERATE_CACHE_KWARG: cache}


KW = {"do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True, "output_scores": True}


def test_greedy_generation_equals_the_full_cache(monkeypatch):
    """A left-padded batch, 30 new tokens (across several segments of every branch): the same
    tokens and scores as transformers' dynamic cache; every step after the prefill is one fused
    step per layer, and the cache's bytes do not grow with the generated length."""
    steps = []
    step = bounded_mod.decode_step
    monkeypatch.setattr(bounded_mod, "decode_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    model = llama()
    x = torch.randint(1, V, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        a = model.generate(x, attention_mask=mask, max_new_tokens=30, **KW)
        cache = dtc.BoundedDilatedCache(model.config)
        b = model.generate(x, attention_mask=mask, **cache_kw(cache), max_new_tokens=30, **KW)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=1e-9, atol=1e-9)
    assert len(steps) == 29 * 2  # 29 steps after the prefill, 2 layers
    assert cache.get_seq_length() == 40 and cache.layers[0].cache.seqlens.tolist() == [40, 36]
    short = dtc.BoundedDilatedCache(model.config)
    with torch.no_grad():
        model.generate(x, attention_mask=mask, **cache_kw(short), max_new_tokens=3, **KW)
    assert short.memory_bytes() == cache.memory_bytes() == 2 * 2 * 2 * 2 * (4 + 2 * 4 + 2 * 4) * 8 * 8


def test_float32_generation_equals_the_full_cache():
    model = llama(dtype=torch.float32)
    x = torch.randint(1, V, (1, 9))
    with torch.no_grad():
        a = model.generate(x, max_new_tokens=20, **KW)
        b = model.generate(x, **cache_kw(dtc.BoundedDilatedCache(model.config)), max_new_tokens=20, **KW)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "version,name",
    [
        ("5.0.0", "past_key_values"),
        ("5.23.1", "past_key_values"),
        ("5.24.0", "cache"),
        ("5.30.0.dev0", "cache"),
    ],
)
def test_generate_cache_kwarg_follows_the_transformers_version(version, name):
    assert dtc._generate_cache_kwarg(version) == name


def test_generate_with_the_documented_argument_warns_nothing():
    """The README's and docs' ``generate(..., cache=...)`` (``past_key_values=`` before
    transformers 5.24): no FutureWarning about a deprecated argument."""
    import warnings

    model = llama(dtype=torch.float32)
    x = torch.randint(1, V, (1, 5))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        model.generate(x, **cache_kw(dtc.BoundedDilatedCache(model.config)), max_new_tokens=3, **KW)


def test_refusals_name_what_cannot_run():
    with pytest.raises(
        ValueError, match="needs a model with attn_implementation='dilated_attention', got 'sdpa'"
    ):
        dtc.BoundedDilatedCache(llama(attn="sdpa").config)
    model = llama()
    x = torch.randint(1, V, (2, 6))
    with pytest.raises(ValueError, match=r"cannot reorder its rows \(beam search\)"), torch.no_grad():
        model.generate(x, **cache_kw(dtc.BoundedDilatedCache(model.config)), num_beams=2, max_new_tokens=3)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0  # right padding
    with pytest.raises(
        ValueError, match=r"left-padded .* row 0 of the attention mask has \[1, 1, 1, 1, 0, 0\]"
    ):
        with torch.no_grad():
            model(x, attention_mask=mask, **cache_kw(dtc.BoundedDilatedCache(model.config)), use_cache=True)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"max_cache_len must be an int >= 1 or None, got {bad!r}"):
            dtc.BoundedDilatedCache(model.config, max_cache_len=bad)
    with pytest.raises(ValueError, match=r"more tokens than max_cache_len=8 .*pass a larger max_cache_len"):
        with torch.no_grad():
            model.generate(
                x, **cache_kw(dtc.BoundedDilatedCache(model.config, max_cache_len=8)), max_new_tokens=5
            )


def test_the_import_path_transformers_cache_is_kept():
    import dilated_attention.transformers_cache as public

    assert public.BoundedDilatedCache is dtc.BoundedDilatedCache
    assert public.GENERATE_CACHE_KWARG == dtc.GENERATE_CACHE_KWARG
