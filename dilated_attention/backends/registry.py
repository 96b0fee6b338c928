"""The registry of backends, the fallback chains, and the selection (made once, logged once).

An explicit request that cannot run falls back along its chain (SPEC section 4)::

    flash_attn_3 -> flash_attn_2 -> sdpa -> manual
    xformers -> sdpa -> manual
    native -> sdpa -> manual
    sdpa -> manual

with one warning (``warnings.warn``, :class:`~dilated_attention.BackendFallbackWarning`, once per
cause in the process) that names what was asked, why it cannot run, and what runs instead. ``auto``
takes the first backend of :func:`dilated_attention.hardware.recommended_backends` that can run.
The backend in use is logged once at INFO. The choice is cached per selector (one per module;
one for the functional API) and per (requested name, device, dtype, head dim, dropout or not), so
the hot path is one dictionary lookup. When nothing can run, the error lists every backend's
reasons.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from .. import hardware
from .._warnings import BackendFallbackWarning, SlowPathWarning, warn_once
from .advice import slow_path
from .base import Backend, BackendRequest, dtype_name
from .flash import FlashAttn2Backend, FlashAttn3Backend
from .manual import ManualBackend
from .native import NativeBackend
from .sdpa import SdpaBackend
from .xformers import XformersBackend

__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_NAMES",
    "FALLBACKS",
    "BackendSelector",
    "Selection",
    "backend_reasons",
    "check_backend_name",
    "default_selector",
    "get_backend",
    "select_backend",
]

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("native", "flash_attn_3", "flash_attn_2", "xformers", "sdpa", "manual")
BACKEND_CHOICES = ("auto", *BACKEND_NAMES)

FALLBACKS: dict[str, tuple[str, ...]] = {
    "native": ("sdpa", "manual"),
    "flash_attn_3": ("flash_attn_2", "sdpa", "manual"),
    "flash_attn_2": ("sdpa", "manual"),
    "xformers": ("sdpa", "manual"),
    "sdpa": ("manual",),
    "manual": (),
}

_REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        NativeBackend(),
        FlashAttn3Backend(),
        FlashAttn2Backend(),
        XformersBackend(),
        SdpaBackend(),
        ManualBackend(),
    )
}


def check_backend_name(name: object) -> str:
    """``name`` if it is one of :data:`BACKEND_CHOICES`, else a ValueError that lists them."""
    if not isinstance(name, str) or name not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKEND_CHOICES)}")
    return name


def get_backend(name: str) -> Backend:
    """The backend object registered under ``name`` (not ``auto``)."""
    if name == "auto" or name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    return _REGISTRY[name]


def backend_reasons(request: BackendRequest) -> dict[str, list[str]]:
    """For every backend, why it cannot run ``request`` (an empty list when it can)."""
    return {name: _REGISTRY[name].all_reasons(request) for name in BACKEND_NAMES}


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection: what was asked, what runs, and what was passed over and why."""

    requested: str
    name: str
    request: BackendRequest
    skipped: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def fell_back(self) -> bool:
        return self.requested != "auto" and self.requested != self.name


def _reasons_text(skipped: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    return "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped)


def resolve(requested: str, request: BackendRequest) -> Selection:
    """Choose a backend for ``request`` (no caching, no logging).

    Raises RuntimeError, listing every backend's reasons, when nothing can run.
    """
    check_backend_name(requested)
    if requested == "auto":
        candidates = hardware.recommended_backends(request.device, request.dtype, request.head_dim)
    else:
        candidates = [requested, *FALLBACKS[requested]]
    skipped: list[tuple[str, tuple[str, ...]]] = []
    for name in candidates:
        why = _REGISTRY[name].all_reasons(request)
        if not why:
            return Selection(requested, name, request, tuple(skipped))
        skipped.append((name, tuple(why)))
    table = "\n".join(
        f"  {name}: {', '.join(why) if why else 'can run, but is not on the path of this request'}"
        for name, why in backend_reasons(request).items()
    )
    raise RuntimeError(
        f"no dilated attention backend can run {request.describe()} (requested {requested!r}, tried "
        f"{' -> '.join(candidates)}). Every backend's reasons:\n{table}"
    )


_SELECTOR_IDS = itertools.count()
_SELECTORS: weakref.WeakValueDictionary[int, BackendSelector] = weakref.WeakValueDictionary()


class BackendSelector:
    """Chooses a backend once per (requested name, device, dtype, head dim, dropout) and remembers it.

    One selector per module (and one for the functional API): the INFO naming the backend in use
    is logged once per selector and key; the warning of a fallback is given once per cause. Thread-safe; copies and
    pickles start with an empty memory.
    """

    def __init__(self, owner: str = "dilated_attention") -> None:
        self.owner = owner
        self._names: dict[tuple, str] = {}
        self._selections: dict[tuple, Selection] = {}
        self._lock = threading.Lock()
        # An int names this selector to _select_constant: torch.compile bakes a call's result into
        # the graph only when its arguments are constants, and older versions refuse an object.
        self._id = next(_SELECTOR_IDS)
        _SELECTORS[self._id] = self

    def __getstate__(self) -> dict:
        return {"owner": self.owner}

    def __setstate__(self, state: dict) -> None:
        BackendSelector.__init__(self, state["owner"])

    def select(
        self, requested: str, q: torch.Tensor, k: torch.Tensor, dropout_p: float = 0.0, branches: int = 1
    ) -> Backend:
        """The backend to run (q, k) with: a dictionary lookup once chosen. ``branches``: the
        number of (segment length, dilation rate) pairs (dropout over several of them needs a
        backend that drops the merged weights)."""
        several = int(branches) > 1
        if torch.compiler.is_compiling():
            # Under dynamic=True the head dim and dropout_p are symbolic: specialise them (a guard each)
            # so that the key is a constant; N never enters the key, so a new N does not recompile.
            dropout = guard_scalar(dropout_p > 0)
            key = (
                requested,
                q.device,
                q.dtype,
                guard_scalar(q.shape[-1]),
                dropout,
                bool(dropout) and several,
            )
            return _REGISTRY[_select_constant(self._id, key)]
        dropout = bool(dropout_p > 0)
        key = (requested, q.device, q.dtype, int(q.shape[-1]), dropout, dropout and several)
        name = self._names.get(key)
        if name is None:
            name = self._choose(key, int(q.shape[2]), int(k.shape[2]))
        return _REGISTRY[name]

    def _choose(self, key: tuple, num_heads: int = 1, num_kv_heads: int = 1) -> str:
        with self._lock:
            name = self._names.get(key)
            if name is not None:
                return name
            requested, device, dtype, head_dim, dropout, merged_dropout = key
            request = BackendRequest(
                device, dtype, head_dim, dropout, num_heads, num_kv_heads, merged_dropout
            )
            sel = resolve(requested, request)
            self._log(sel)
            self._selections[key] = sel
            self._names[key] = sel.name
            return sel.name

    def _log(self, sel: Selection) -> None:
        where = f"{sel.request.device} {dtype_name(sel.request.dtype)}"
        if sel.fell_back:
            message = (
                f"{self.owner}: attention backend {sel.requested!r} was requested but cannot run on "
                f"{sel.request.describe()} ({_reasons_text(sel.skipped)}); using {sel.name!r} instead"
            )
            # The contract's logged WARNING (once per selection), and a warning a user sees without
            # any logging set up (once per cause in the process).
            logger.warning("%s", message)
            warn_once(
                ("fallback", sel.requested, sel.name, sel.request.cache_key), message, BackendFallbackWarning
            )
        slow = slow_path(sel.name, sel.request)
        if slow:
            warn_once(("slow", sel.name, sel.request.cache_key), f"{self.owner}: {slow}", SlowPathWarning)
        how = (
            "requested"
            if sel.requested == sel.name
            else ("auto" if sel.requested == "auto" else f"fallback from {sel.requested!r}")
        )
        extra = f"; passed over {_reasons_text(sel.skipped)}" if sel.skipped else ""
        logger.info("%s: using attention backend %r on %s (%s%s)", self.owner, sel.name, where, how, extra)

    def selections(self) -> list[Selection]:
        """The selections made so far."""
        with self._lock:
            return list(self._selections.values())

    def describe(self) -> str:
        """``"native (cpu float32)"``-style summary of the selections so far, for ``extra_repr``."""
        sels = self.selections()
        if not sels:
            return "not selected yet"
        return ", ".join(
            f"{s.name} ({s.request.device} {dtype_name(s.request.dtype)}"
            + (", dropout)" if s.request.dropout else ")")
            for s in sels
        )

    def clear(self) -> None:
        """Forget the choices (the next call chooses and logs again)."""
        with self._lock:
            self._names.clear()
            self._selections.clear()


@torch._dynamo.assume_constant_result
def _select_constant(selector_id: int, key: tuple) -> str:
    # Under torch.compile the choice is made at trace time and baked into the graph.
    selector = _SELECTORS[selector_id]
    name = selector._names.get(key)
    return name if name is not None else selector._choose(key)


_DEFAULT = BackendSelector("dilated_attention")


def default_selector() -> BackendSelector:
    """The selector of the functional API."""
    return _DEFAULT


def select_backend(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    branches: int = 1,
    selector: BackendSelector | None = None,
) -> Backend:
    """The backend that runs ``name`` for (q, k), the dropout asked for and the number of
    branches (see module doc)."""
    check_backend_name(name)
    return (selector or _DEFAULT).select(name, q, k, dropout_p, branches)
