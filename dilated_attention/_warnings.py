"""What a user must see: ``warnings.warn`` once per cause, with categories that can be filtered.

Python shows a ``UserWarning`` by default, so these reach a user's own script without any
logging set up (the package's logger, by contrast, stays silent until the user configures
logging). Each cause (a backend that cannot run these inputs, a branch configuration that leaves
positions without a head, ...) is warned about once per process, however many modules or calls
meet it (:func:`warn_once`); the misuse of an object (a key/value cache used out of order) once
per object (:func:`warn_user`, with a flag on the object).
``warnings.simplefilter("ignore", DilatedAttentionWarning)`` silences them all.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Hashable
from types import FrameType, ModuleType

import torch

__all__ = [
    "BackendFallbackWarning",
    "CacheUsageWarning",
    "DenseWeightsWarning",
    "DilatedAttentionWarning",
    "ExtensionWarning",
    "LayoutWarning",
    "SequenceSplitWarning",
    "SlowPathWarning",
    "UncoveredPositionsWarning",
    "VersionWarning",
    "reset_warnings",
    "skip_frames_of",
    "warn_once",
    "warn_user",
]


class DilatedAttentionWarning(UserWarning):
    """Base class of every warning this package emits."""


class BackendFallbackWarning(DilatedAttentionWarning):
    """A requested attention backend cannot run these inputs; another one runs instead."""


class ExtensionWarning(DilatedAttentionWarning):
    """The compiled extension is missing or does not match this PyTorch; ``native`` cannot run."""


class SlowPathWarning(DilatedAttentionWarning):
    """float16/bfloat16 inputs are sent to kernels that are slow for them."""


class UncoveredPositionsWarning(DilatedAttentionWarning):
    """The branches leave positions that no head attends from: their output is 0."""


class LayoutWarning(DilatedAttentionWarning):
    """The inputs look like another layout than the one expected (e.g. (B, H, N, D) for (B, N, H, D))."""


class SequenceSplitWarning(DilatedAttentionWarning):
    """A module configured to split the sequence across ranks runs without a process group: every
    process computes the tensor it was given as the whole sequence."""


class DenseWeightsWarning(DilatedAttentionWarning):
    """A model whose weights were trained with dense attention now runs dilated attention: unlike a
    switch between eager, SDPA and FlashAttention, this changes the function the model computes."""


class CacheUsageWarning(DilatedAttentionWarning):
    """A key/value cache is used out of its order of calls (a layer attended twice in one step,
    without ``advance`` between): the second call's tokens overwrite the first's positions. Each
    cache warns once, on its first misuse."""


class VersionWarning(DilatedAttentionWarning):
    """An optional library the package plugs into is outside the range it is tested with."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames in these folders are not the user's: the package's own, torch's (nn.Module.__call__), and
# those of libraries the package plugs into (transformers' model code), added by skip_frames_of.
_SKIPPED_DIRS: tuple[str, ...] = (_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)))
_seen: set[Hashable] = set()
_lock = threading.Lock()


def _stacklevel() -> int:
    """The stack level of the first caller outside this package and torch (the user's line),
    counted as ``warnings.warn`` counts it from ``warn_once`` (importlib's frames are not counted)."""
    frame: FrameType | None = sys._getframe(1)  # warn_once: level 1
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back  # skipped by warnings.warn too
            continue
        if not os.path.abspath(name).startswith(_SKIPPED_DIRS):
            return level
        frame = frame.f_back
        level += 1
    return 1


def _user_frame() -> FrameType | None:
    """The frame of the first caller outside this package and torch (the user's line), or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not ("importlib" in name and "_bootstrap" in name) and not os.path.abspath(name).startswith(
            _SKIPPED_DIRS
        ):
            return frame
        frame = frame.f_back
    return None


def warn_user(message: str, category: type[Warning] = DilatedAttentionWarning) -> None:
    """Warn at the user's line every time it is called: the caller decides how often (e.g. once per
    object, with a flag on it). Unlike ``warnings.warn``, a second warning with the same text from
    the same line is shown too (Python's default filter shows a text once per line): two objects
    misused by the same line of a loop each say so. The filters still apply (``"ignore"``,
    ``"error"``, ``"once"``)."""
    frame = _user_frame()
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__", "<string>"),
        registry=None,  # no per-line registry: how often is the caller's decision
    )


def warn_once(cause: Hashable, message: str, category: type[Warning] = DilatedAttentionWarning) -> bool:
    """``warnings.warn(message, category)`` the first time ``cause`` is met in this process.

    Returns whether it warned. ``cause`` identifies what went wrong (not where), so that twelve
    layers meeting the same problem give one warning.
    """
    key = (category, cause)
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    # Both count warn_once's own frame as level 1.
    warnings.warn(message, category, stacklevel=_stacklevel())
    return True


def skip_frames_of(module: ModuleType) -> None:
    """Count the frames of ``module``'s package folder as not the user's, so that a warning set off
    through that library's code (a transformers model calling the attention function) points at
    the user's line that called the library."""
    global _SKIPPED_DIRS
    path = os.path.dirname(os.path.abspath(module.__file__ or ""))
    with _lock:
        if path not in _SKIPPED_DIRS:
            _SKIPPED_DIRS = (*_SKIPPED_DIRS, path)


def reset_warnings() -> None:
    """Forget which causes were warned about, so that each warns again (for tests)."""
    with _lock:
        _seen.clear()
