"""Dilated attention inside HuggingFace ``transformers`` models (the optional extra ``transformers``).

Importing this module registers, under the name ``"dilated_attention"``, an attention function
with transformers' ``AttentionInterface`` and a mask function with its ``AttentionMaskInterface``::

    import dilated_attention.transformers  # noqa: F401  (registers "dilated_attention")
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(..., dilated_attention={"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dilated_attention")

The branches come from ``config.dilated_attention`` (keys ``segment_lengths``, ``dilation_rates``,
``backend``; :data:`DEFAULT_CONFIG` where absent). What the model asks for is honoured or refused,
never dropped:

* causal or bidirectional self-attention, grouped-query attention, ``scaling``, attention dropout;
* padding (SPEC section 7): each row's contiguous run of real tokens, left or right padded, is a
  sequence of its own starting at position 0; padded positions give 0. A mask whose real tokens
  are not contiguous is a ``ValueError`` naming the row;
* the key/value cache of ``generate()``: the new tokens attend to the cache through
  :func:`dilated_attention.dilated_attention_decode`, reading ``O(sum w_i / r_i)`` keys each;
* a pattern it cannot run (sliding window, chunked attention, packed sequences given by
  ``position_ids``, a custom mask overlay or a ready-made 4-D mask, soft-capping, attention sinks,
  a position bias) is a ``ValueError``;
* cross-attention (an encoder-decoder's decoder attending to the encoder, ``add_cross_attention``)
  is a ``ValueError`` naming the layer: dilated attention is defined over one sequence. With
  ``config.dilated_attention["cross_attention"] = "dense"`` those layers run dense (SDPA) instead.
  A call is cross-attention by what it attends to (a layer marked so, or a call given the states of
  its keys, ``key_value_states``), not by the layer's flags: a decoder's self-attention built
  ``is_decoder=True, is_causal=False`` (BigBirdPegasus, NLLB-MoE) runs dilated and causal, as the
  causal mask transformers makes for it says;
* a model whose attention layers do not call transformers' attention interface (BLOOM, CodeGen,
  Falcon, ...), or that has no attention layer (Mamba, RWKV), is a ``ValueError`` naming its
  class when built with or switched to it (:mod:`dilated_attention.transformers.dispatch`);
* switching a model with trained (dense) weights warns once (:class:`DenseWeightsWarning`): unlike
  eager/SDPA/FlashAttention, dilated attention computes another function.

The package, by role: :mod:`.attention` (the attention and mask functions), :mod:`.layers` (what one
attention call may run: cross-attention, the values it cannot honour), :mod:`.dispatch` (which model
classes reach the attention interface at all, and the warning when trained weights change
function), :mod:`.cache` (``BoundedDilatedCache`` for ``generate()``; also importable as
``dilated_attention.transformers_cache``).
"""

from __future__ import annotations

from .._warnings import DenseWeightsWarning, VersionWarning, warn_once

# _requires first: without transformers, its ImportError says what to install.
from . import _requires, attention
from . import dispatch as _dispatch
from .attention import (
    DEFAULT_CONFIG,
    NAME,
    cross_attention_mode,
    dilated_attention_forward,
    dilated_attention_mask,
    padded_attention,
    settings,
)
from .dispatch import dispatch_problem
from .layers import describe

TESTED_VERSIONS = _requires.TESTED_VERSIONS
_transformers = _requires.transformers
AttentionInterface = _requires.AttentionInterface
AttentionMaskInterface = _requires.AttentionMaskInterface

__all__ = [
    "DEFAULT_CONFIG",
    "NAME",
    "TESTED_VERSIONS",
    "DenseWeightsWarning",
    "attention",
    "cross_attention_mode",
    "describe",
    "dilated_attention_forward",
    "dilated_attention_mask",
    "dispatch_problem",
    "padded_attention",
    "register",
    "settings",
]


def register(name: str = NAME) -> str:
    """Register the attention function and the mask function under ``name`` (done for
    ``"dilated_attention"`` on import); returns ``name`` for ``attn_implementation=``.

    ``name`` must be a non-empty string that does not name one of transformers' own
    implementations (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...): registering over one
    would make every model that asks for it run dilated attention. ValueError otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    builtin = _builtin_implementations()
    if name in builtin:
        raise ValueError(
            f"register: {name!r} is one of transformers' own attention implementations "
            f"({', '.join(sorted(builtin))}); registering over it would make every model that asks for "
            "it run dilated attention. Choose another name"
        )
    AttentionInterface.register(name, dilated_attention_forward)
    AttentionMaskInterface.register(name, dilated_attention_mask)
    _dispatch.NAMES.add(name)
    _dispatch.install(settings)
    return name


def _builtin_implementations() -> set[str]:
    """The attention implementations transformers itself defines (before any registration)."""
    names = {"eager", *getattr(AttentionMaskInterface, "_global_mapping", {})}
    names |= set(getattr(AttentionInterface, "_global_mapping", {}))
    names = {part for n in names for part in n.split("|")}  # "paged|eager"
    return names - _dispatch.NAMES


def _check_version() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(_transformers.__version__) not in SpecifierSet(TESTED_VERSIONS):
        warn_once(
            ("transformers-version", _transformers.__version__),
            f"dilated_attention.transformers is tested with transformers{TESTED_VERSIONS}, found "
            f"{_transformers.__version__}: its attention and mask interfaces may differ",
            VersionWarning,
        )


_check_version()
register()
