"""Which transformers models dilated attention can run in, checked when a model is built with it
or switched to it, and the warning when a model's trained weights meet a new attention function.

transformers checks a custom attention implementation only for its name. A model whose attention
layers do not call the attention interface (BLOOM, CodeGen, XGLM, Falcon, GPT-J, GPT-Neo, MPT, ...)
would then run its own dense attention while its config reports dilated attention, or fail deep
inside with a ``KeyError``. :func:`install` wraps ``PreTrainedModel.get_correct_attn_implementation``
(called before a model's layers are built), ``post_init`` (which every model's constructor calls
last) and ``set_attn_implementation`` so that a model with an attention layer
that computes attention itself instead of dispatching through ``ALL_ATTENTION_FUNCTIONS``, or a
model with no attention layer at all (Mamba, RWKV: the implementation would change nothing), is
refused by name. Models given another implementation pass through untouched.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from .. import _warnings
from .._warnings import DenseWeightsWarning, warn_once
from .layers import watch_key_sources

# The names this package registered its attention function under (dilated_attention.transformers.register).
NAMES: set[str] = set()

# What marks an attention layer that computes attention itself rather than through the interface:
# a softmax, torch's SDPA, flash-attn, or a per-implementation table of classes indexed by the name.
_COMPUTES = re.compile(
    r"softmax|scaled_dot_product_attention|flash_attn|_attn_implementation\]", re.IGNORECASE
)
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# A model that picks its attention layer classes from its own table by the implementation's name
# (FALCON_ATTENTION_CLASSES[config._attn_implementation]) fails with a KeyError while it is built.
_TABLE = re.compile(r"(\w+)\[(?:self\.)?(?:config\.)?_?attn_implementation\]")


_CLASS_PROBLEMS: dict[type, str | None] = {}


def _class_problem(cls: type) -> str | None:
    """Why the attention layer class ``cls`` does not run a registered function, or None: the class
    that defines its ``forward`` computes attention (a softmax, SDPA, flash-attn, a table of classes
    per implementation) and never reads ``ALL_ATTENTION_FUNCTIONS``."""
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    if owner is None or owner.__module__.startswith("torch."):
        return None
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return f"the source of its attention layer {owner.__qualname__} cannot be read to check it"
    if _COMPUTES.search(source) and _INTERFACE not in source:
        return f"its attention layer {owner.__qualname__} ({owner.__module__}) computes attention itself instead of calling {_INTERFACE}"
    return None


@functools.cache
def _table_problem(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    for found in _TABLE.finditer(source):
        if found.group(1) not in (_INTERFACE, "ALL_MASK_ATTENTION_FUNCTIONS"):
            return f"it picks its attention layers from its own table {found.group(1)} ({module_name})"
    return None


def class_problem(cls: type) -> str | None:
    """Why the model class ``cls`` cannot even be built with a registered implementation, or None:
    a module of its MRO picks the attention layer classes from a table indexed by the name."""
    for klass in cls.__mro__:
        if klass is not PreTrainedModel and issubclass(klass, PreTrainedModel):
            problem = _table_problem(klass.__module__)
            if problem is not None:
                return problem
    return None


@functools.cache
def _module_dispatches(module_name: str) -> bool:
    """Whether the source of the module ``module_name`` reads :data:`_INTERFACE` (True where the
    source cannot be read: the check then lets the model through rather than refuse it blind)."""
    module = sys.modules.get(module_name)
    if module is None:
        return True
    try:
        return _INTERFACE in inspect.getsource(module)
    except (OSError, TypeError):
        return True


def _model_code(module_name: str) -> bool:
    """Whether ``module_name`` holds a model's own code: a module of ``transformers.models`` or one
    outside transformers and torch (remote code), not the shared machinery (``modeling_utils``
    defines the interface itself)."""
    if module_name.startswith("transformers."):
        return module_name.startswith("transformers.models.")
    return module_name.split(".")[0] not in ("torch", "builtins")


def _no_attention_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` has no attention layer for a registered function to run, or None: no module
    that defines one of its classes (the model's and its submodules') reads :data:`_INTERFACE`.
    Recurrent and state-space models (Mamba, Mamba2, FalconMamba, RWKV) have none, so an
    attention implementation changes nothing in them."""
    classes = [*type(model).__mro__, *(type(m) for m in model.modules())]
    names = dict.fromkeys(k.__module__ for k in classes if _model_code(k.__module__))
    if any(_module_dispatches(name) for name in names):
        return None
    return (
        "it has no attention layer that calls transformers' attention interface (a recurrent or "
        "state-space model computes no attention for an attention implementation to replace)"
    )


def _inside_another_model(model: Any) -> bool:
    """Whether ``model`` is being built inside the constructor of another model (a vision tower or
    a backbone of a composite model): a frame up the stack is the ``__init__`` of another
    ``PreTrainedModel``."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, PreTrainedModel):
                return True
        frame = frame.f_back
    return False


def dispatch_problem(model: torch.nn.Module, attention_free: bool = True) -> str | None:
    """Why ``model`` would not run a registered attention function in all its attention layers, or
    None. Every submodule whose class name contains "Attention" is checked by the source of the
    class that defines its ``forward`` (:func:`_class_problem`); a model none of whose modules
    reaches the attention interface at all (a recurrent or state-space model) is refused too
    (:func:`_no_attention_problem`), unless ``attention_free`` is False (a part of a composite
    model, such as a convolutional vision tower, which the whole model's check covers)."""
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        if "attention" in cls.__name__.lower():
            if cls not in _CLASS_PROBLEMS:
                _CLASS_PROBLEMS[cls] = _class_problem(cls)
            problem = _CLASS_PROBLEMS[cls]
            if problem is not None:
                return problem
    return _no_attention_problem(model) if attention_free else None


def check_dispatch(model: Any, name: str, problem: str | None = None, part: bool = False) -> None:
    """Raises a ValueError naming the model's class if its attention layers would not run ``name``
    (``problem``: found already, else :func:`dispatch_problem`; ``part``: ``model`` is built inside
    another model, whose own check decides whether the whole has an attention layer)."""
    problem = problem or dispatch_problem(model, attention_free=not part)
    if problem is not None:
        raise ValueError(
            f"{type(model).__name__} (model type {getattr(model.config, 'model_type', '?')!r}) cannot run "
            f"attn_implementation={name!r}: {problem}, so the model would silently keep computing "
            f"what it computes without it (or fail) while its config reports {name!r}. "
            f"Dilated attention runs in the models whose attention layers call transformers' attention "
            f"interface (GPT-2, Llama, Mistral, Qwen, BERT, ...; see docs/transformers.md)"
        )


_warnings.skip_frames_of(transformers)  # warnings set off through model code name the user's line


def warn_dense_weights(model: Any, name: str, previous: str | None, settings: Callable[[Any], Any]) -> None:
    """Warns once per model type and branches that ``model``, whose weights were trained with ``previous`` (a dense
    implementation; None: a checkpoint that carries no branches), now runs dilated attention.
    Silent when the branches are dense for every position the model takes (one branch, ``r = 1``,
    ``w >= max_position_embeddings``)."""
    config = model.config
    segs, rates, _ = settings(config)
    n = getattr(config, "max_position_embeddings", None)
    if len(segs) == 1 and rates == [1] and isinstance(n, int) and segs[0] >= n:
        return
    how = f"switching it from {previous!r}" if previous else "loading its checkpoint"
    default = (
        ""
        if getattr(config, "dilated_attention", None)
        else " (config.dilated_attention unset: the defaults)"
    )
    warn_once(
        ("dense-weights", getattr(config, "model_type", ""), tuple(segs), tuple(rates)),
        f"{type(model).__name__}: {how} to {name!r} changes the function the model computes: its "
        f"weights were trained with dense attention, and it now runs dilated attention with "
        f"segment_lengths={segs}, dilation_rates={rates}{default} (unlike a switch between eager, sdpa "
        f"and flash_attention_2, which compute the same function). To keep inputs of up to N tokens "
        f"dense, use one branch with w >= N and r = 1: config.dilated_attention = "
        f"{{'segment_lengths': [N], 'dilation_rates': [1]}} (docs/transformers.md)",
        DenseWeightsWarning,
    )


def _loading_weights() -> bool:
    """Whether the model being built will load trained weights: ``from_pretrained`` builds it on
    the meta device (``from_config`` and a plain constructor do not)."""
    return torch.empty(()).device.type == "meta"


def install(settings: Callable[[Any], Any]) -> None:
    """Wraps ``PreTrainedModel.post_init`` (the end of every model's constructor) and
    ``set_attn_implementation`` (once per process) so that a model built with or switched to one of
    :data:`NAMES` has its attention layers checked, and a warning when trained weights change
    function; ``settings`` reads the branches from a config."""
    if getattr(PreTrainedModel, "_dilated_attention_checks", False):
        return
    post_init = PreTrainedModel.post_init
    set_impl = PreTrainedModel.set_attn_implementation
    get_correct = PreTrainedModel.get_correct_attn_implementation

    @functools.wraps(get_correct)
    def get_correct_attn_implementation(
        self: Any, requested_attention: Any, *args: Any, **kwargs: Any
    ) -> Any:
        chosen = get_correct(self, requested_attention, *args, **kwargs)
        if chosen in NAMES:  # before the layers are built: a table lookup would fail with a KeyError
            problem = class_problem(type(self))
            if problem is not None:
                check_dispatch(self, chosen, problem)
        return chosen

    @functools.wraps(post_init)
    def checked_post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = post_init(self, *args, **kwargs)
        chosen = getattr(self.config, "_attn_implementation", None)
        if isinstance(chosen, str) and chosen in NAMES:
            check_dispatch(self, chosen, part=_inside_another_model(self))
            watch_key_sources(self)
            if _loading_weights() and getattr(self.config, "dilated_attention", None) is None:
                warn_dense_weights(self, chosen, None, settings)  # a checkpoint saved without branches
        return out

    @functools.wraps(set_impl)
    def set_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        requested = attn_implementation
        if isinstance(requested, dict):
            requested = requested.get("")
        previous = self.config._attn_implementation
        if requested in NAMES:  # refused here too: transformers only logs for a class it cannot switch
            check_dispatch(self, requested)
        out = set_impl(self, attn_implementation, *args, **kwargs)
        if requested in NAMES:
            watch_key_sources(self)
        if requested in NAMES and previous not in NAMES:
            warn_dense_weights(self, requested, previous, settings)
        return out

    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation  # type: ignore[method-assign]
    PreTrainedModel.post_init = checked_post_init  # type: ignore[method-assign]
    PreTrainedModel.set_attn_implementation = set_attn_implementation  # type: ignore[method-assign]
    PreTrainedModel._dilated_attention_checks = True  # type: ignore[attr-defined]
