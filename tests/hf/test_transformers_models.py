"""Every architecture of transformers' causal-LM auto mapping, built from a tiny config (random
weights, no downloads), is either honoured or refused by name under dilated attention:

* refused when built: the error names the model class and an attention layer class, and a probe
  attention function registered under another name confirms, by running the model, that this
  layer computes attention without calling the attention interface (or that the model cannot run
  a registered implementation at all);
* refused as attention-free (Mamba, RWKV, ...): under the probe no layer calls the interface;
* or run: with one dense branch (w >= N, r = 1) its logits equal the same weights under
  transformers' SDPA (eager where the model has no SDPA), with the registered function called; or
  the forward raises the integration's ValueError for a pattern it cannot honour (a sliding
  window, a custom mask, ...).

A fast subset runs always; the whole mapping with DILATED_ATTENTION_SLOW=1."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

transformers = pytest.importorskip("transformers")

from common import one_thread  # noqa: E402, F401  (after the skip; one_thread: an autouse fixture)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import dilated_attention.transformers as dt  # noqa: E402

SLOW = os.environ.get("DILATED_ATTENTION_SLOW") == "1"
N = 12
DENSE = {"segment_lengths": [16], "dilation_rates": [1]}
# Always run: decoders that dispatch (GPT-2, Llama, BERT, OPT) and those that bypass the interface.
FAST = ["gpt2", "llama", "bert", "opt", "bloom", "codegen", "xglm", "falcon", "gptj", "gpt_neo", "mpt", "git"]
# Architectures whose tiny config the generic shrinking below cannot build (their sizes are tied
# in ways that need per-model values, or they need a package that is not installed); skipped by name.
CANNOT_BUILD_TINY = {
    "blt": "the default patcher/encoder sub-configs need several GB even when shrunk",
    "dbrx": "DbrxAttentionConfig has no rope_theta when rebuilt",
    "dots1": "expert tensors cannot be built in float64 on CPU",
    "dots3_note": "per-layer attributes (per_layer_config) not settable globally",
    "dots3_note_text": "per-layer attributes (per_layer_config) not settable globally",
    "gemma3n": "needs timm",
    "gemma3n_text": "KV-sharing layer types cannot be cut to two layers",
    "gemma4": "per-layer attributes (per_layer_config) not settable globally",
    "gemma4_assistant": "tied per-layer-input sizes",
    "gemma4_text": "per-layer attributes (per_layer_config) not settable globally",
    "gemma4_unified": "per-layer attributes (per_layer_config) not settable globally",
    "gemma4_unified_assistant": "per-layer attributes (per_layer_config) not settable globally",
    "gemma4_unified_text": "per-layer attributes (per_layer_config) not settable globally",
    "hunyuan_v1_dense": "rope settings missing from the default config",
    "hunyuan_v1_moe": "rope settings missing from the default config",
    "ministral": "rope settings missing from the default config",
    "nemotron": "partial rotary settings missing from the default config",
    "inkling2_text": "float32 parameters created inside forward",
    "longcat_flash": "multi-latent attention sizes tied to the defaults",
    "lfm2_moe": "its layer types cannot be cut to two layers",
    "moss_transcribe_diarize": "the default audio encoder is too large to build",
    "phi4_multimodal": "the default audio/vision encoders are too large to build",
    "musicgen": "the composite config needs text/audio sub-configs",
    "musicgen_melody": "the composite config needs text/audio sub-configs",
    "reformer": "needs is_decoder and axial position shapes tied to the length",
    "rwkv": "its sizes are tied to the default context length",
    "xlnet": "permutation language model, no attention mask path",
    "xlstm": "recurrent sizes tied to the defaults",
    "xmod": "needs a default language set on the model before a forward",
    "hrm_text": "its recurrent cycles index layers beyond two",
    "cohere_compass_text": "its layer types cannot be cut to two layers",
    "axk2": "sparse-attention indexer sizes tied to the defaults",
    "deepseek_v32": "sparse-attention indexer sizes tied to the defaults",
    "glm_moe_dsa": "sparse-attention indexer sizes tied to the defaults",
    "hy_v4": "attention sizes tied to the defaults",
    "got_ocr2": "its refused vision layer runs only on image inputs",
}
# Hybrid models (attention and recurrent/linear layers): their layer pattern is a read-only property
# or a list that two layers cannot follow, so a tiny config keeps no attention layer.
CANNOT_BUILD_TINY.update(
    dict.fromkeys(
        (
            "bamba",
            "granitemoehybrid",
            "jamba",
            "recurrent_gemma",
            "zamba",
            "zamba2",
            "qwen4_exp",
            "qwen4_exp_text",
        ),
        "hybrid: two layers of a tiny config keep no attention layer",
    )
)
CANNOT_BUILD_TINY.update(
    dict.fromkeys(
        ("bailing_hybrid", "falcon_h1", "kimi_linear", "lfm3", "nemotron_h", "olmo_hybrid", "qwen3_next"),
        "hybrid: two layers of a tiny config keep no attention layer",
    )
)
CANNOT_BUILD_TINY.update(
    dict.fromkeys(
        ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        "hybrid: two layers keep no attention layer",
    )
)
SIZES = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 99,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "shared_expert_intermediate_size": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "ffn_dim": 64,
    "rotary_dim": 4,
}
# Multi-latent attention (DeepSeek-style) needs as many key/value heads as query heads.
MLA = {"num_key_value_heads": 4}
OVERRIDES: dict[str, dict] = dict.fromkeys(
    ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite"), MLA
)
OVERRIDES.update(dict.fromkeys(("glm_moe_dsa", "hy_v4", "minicpm3"), MLA))
OVERRIDES["big_bird"] = {"attention_type": "original_full"}  # block-sparse is refused; full dispatches
OVERRIDES["mamba2"] = {"num_heads": 8}  # expand * hidden_size / head_dim


def _cut_layer_types(types: list) -> list:
    """Two layers, keeping a full-attention layer where the model has one."""
    kinds = list(dict.fromkeys(types))
    full = [k for k in kinds if "full" in str(k) or str(k) in ("attention", "global")]
    rest = [k for k in kinds if k not in full]
    picked = (full[:1] + rest)[:2] if full else kinds[:2]
    return (picked * 2)[:2]


def _shrink(cfg, sizes: dict) -> None:
    for key, value in sizes.items():
        old = getattr(cfg, key, None)
        if isinstance(old, str) or key == "attention_type":
            setattr(cfg, key, value)
        elif isinstance(old, int) and not isinstance(old, bool):
            try:
                setattr(cfg, key, value)
            except (AttributeError, TypeError, ValueError, NotImplementedError):
                pass
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) > 2:
        try:
            cfg.layer_types = _cut_layer_types(list(types))
        except (AttributeError, TypeError, ValueError):
            pass
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= sizes["vocab_size"]:
            setattr(cfg, key, 0)


def tiny_config(model_type: str, branches: dict = DENSE):
    cfg = CONFIG_MAPPING[model_type]()
    sizes = {**SIZES, **OVERRIDES.get(model_type, {})}
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None:
            _shrink(c, sizes)
            c.dilated_attention = branches
    return cfg


def build(model_type: str, attn: str):
    cfg = tiny_config(model_type)
    cls = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    if not isinstance(cfg, cls.config_class) and getattr(cfg, "text_config", None) is not None:
        cfg = cfg.text_config  # a text-only causal LM registered under a composite config
    kw = {"experts_implementation": "eager"} if hasattr(cfg, "_experts_implementation") else {}
    torch.manual_seed(0)
    return cls._from_config(cfg, attn_implementation=attn, **kw).double().eval()


def tokens() -> torch.Tensor:
    return torch.randint(1, 90, (2, N), generator=torch.Generator().manual_seed(1))


PROBE = "dilated_attention_test_probe"


@pytest.fixture
def probe(monkeypatch):
    """An attention implementation registered under another name that runs SDPA and records the
    modules it is called with (transformers passes the attention layer as the first argument)."""
    seen: list = []
    sdpa = transformers.AttentionInterface._global_mapping["sdpa"]

    def fn(module, *args, **kwargs):
        seen.append(module)
        return sdpa(module, *args, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, PROBE, fn)
    mask = AttentionMaskInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, PROBE, mask)
    return seen


def _bypassing_layer_ran(model_type: str, layer: str | None, seen: list) -> bool:
    """Runs the model under the probe implementation: True when the model cannot be built or run
    with a registered implementation (it fails looking the name up, or its own mask code fails), or when an instance of
    ``layer`` ran without the probe being called for it or any of its submodules."""
    try:
        model = build(model_type, PROBE)
    except (KeyError, AttributeError) as exc:
        return PROBE in str(exc) or "attn_implementation" in str(exc)
    if layer is None:
        return False
    # The probe is SDPA under another name: a model whose layers all dispatch runs with it.
    ran: list = []
    for m in model.modules():
        if type(m).__name__ == layer:
            m.register_forward_hook(lambda mod, args, out: ran.append(mod))
    try:
        with torch.no_grad():
            model(tokens())
    except Exception:  # e.g. MPT: its own mask code gets None from the registered mask function
        return True
    dispatched = {id(m) for m in seen}
    return any(not any(id(sub) in dispatched for sub in mod.modules()) for mod in ran)


def _raised_here(exc: BaseException) -> bool:
    """Whether the integration (dilated_attention's transformers modules) raised ``exc``."""
    files = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    return any(os.sep + "dilated_attention" + os.sep in f for f in files[-3:])


def _types():
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        marks = []
        if t in CANNOT_BUILD_TINY:
            marks.append(pytest.mark.skip(reason=f"cannot be built tiny: {CANNOT_BUILD_TINY[t]}"))
        elif t not in FAST:
            marks.append(pytest.mark.slow)
            marks.append(pytest.mark.skipif(not SLOW, reason="the whole mapping: DILATED_ATTENTION_SLOW=1"))
        yield pytest.param(t, marks=marks, id=t)


@pytest.mark.parametrize("model_type", list(_types()))
def test_causal_lm_architecture_is_honoured_or_refused(model_type, probe, monkeypatch):
    calls: list = []
    forward = dt.dilated_attention_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, dt.NAME, spy)
    try:
        model = build(model_type, dt.NAME)
    except ValueError as exc:
        message = str(exc)
        if "cannot run attn_implementation" not in message:
            raise
        assert "model type" in message
        if "it has no attention layer" in message:  # a recurrent or state-space model
            other = build(model_type, PROBE)
            with torch.no_grad():
                other(tokens())
            assert not probe, f"{model_type} refused as attention-free, but a layer called the interface"
            return
        layer = None  # a table of layer classes by name: building under the probe fails
        if "its attention layer " in message:
            layer = message.split("its attention layer ")[1].split()[0].split(".")[-1]
        assert _bypassing_layer_ran(model_type, layer, probe), (
            f"{model_type} refused, but {layer} dispatches through the attention interface: {message}"
        )
        return
    x = tokens()
    try:
        with torch.no_grad():
            out = model(x).logits
    except ValueError as exc:
        assert _raised_here(exc), f"{model_type}: {exc}"  # a pattern refused by the integration
        return
    layers = [m for m in model.modules() if "attention" in type(m).__name__.lower()]
    assert calls or not layers, f"{model_type} ran without calling the registered attention function"
    try:
        ref, tol = build(model_type, "sdpa"), 1e-9
    except (ValueError, ImportError):
        ref, tol = build(model_type, "eager"), 1e-6  # eager softmax may run in float32
    with torch.no_grad():
        torch.testing.assert_close(out, ref(x).logits, rtol=tol, atol=tol)
