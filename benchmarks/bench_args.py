"""Command-line checks shared by the benchmark scripts.

``type=`` functions for argparse (a bad value is argparse's usage error, exit status 2, naming the
option and the value) and checks of several options together that call ``parser.error``. Nothing
here imports torch or the package at import time: ``bench_sdpa_views.py`` runs its measurements
with another checkout on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

K = 1024
MAX_HEAD_DIM = 256  # dilated_attention's limits (dilated_attention/_validation.py)
MAX_BRANCHES = 16


def _int(text: str) -> int:
    """An int, with an optional ``k`` (x 1024) or ``m`` (x 1024**2) suffix: ``4k``, ``1m``, ``1.5k``."""
    part = text.strip().lower()
    mult = 1
    if part.endswith("k"):
        mult, part = K, part[:-1]
    elif part.endswith("m"):
        mult, part = K * K, part[:-1]
    try:
        value = float(part) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (e.g. 4096 or 4k), got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"expected an integer (e.g. 4096 or 4k), got {text!r}")
    return int(value)


def int_list(text: str) -> list[int]:
    """Comma-separated ints with optional k/m suffixes: ``4k,16k,1m``."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [_int(p) for p in parts]


def names_among(choices: Sequence[str], what: str = "backends") -> Callable[[str], list[str]]:
    """A ``type=`` for comma-separated names, each one of ``choices`` (``dense,auto,native``)."""

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(
                f"expected {what} among {','.join(choices)}, got {text!r}"
                + (f" ({', '.join(bad)} unknown)" if bad else "")
            )
        return names

    return parse


def _at_least(parse: Callable[[str], Any], low: float, strict: bool = False) -> Callable[[str], Any]:
    """``parse`` (a number or a list of numbers), then every value ``>= low`` (``> low`` if strict)."""
    bound = f"> {low}" if strict else f">= {low}"

    def check(text: str) -> Any:
        value = parse(text)
        values = value if isinstance(value, list) else [value]
        if any(v <= low if strict else v < low for v in values):
            raise argparse.ArgumentTypeError(f"every value must be {bound}, got {text!r}")
        return value

    return check


positive_int_list = _at_least(int_list, 1)  # comma-separated ints >= 1 (k/m suffixes allowed)
nonnegative_int_list = _at_least(int_list, 0)
positive_int = _at_least(_int, 1)
nonnegative_int = _at_least(_int, 0)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


positive_float = _at_least(_float, 0, strict=True)
nonnegative_float = _at_least(_float, 0)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def device(text: str) -> str:
    """A torch device string that names a device this machine has (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"not a device (e.g. cpu, cuda, cuda:1), got {text!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} was asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return text


def existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not a directory: {text!r}")
    return text


def check_branches(
    parser: argparse.ArgumentParser,
    segments: Sequence[int],
    rates: Sequence[int],
    seg_opt: str = "--segments",
    rate_opt: str = "--rates",
) -> None:
    """Segment lengths and dilation rates as dilated attention takes them: as many of each (at most
    16), every segment length >= 1 and every rate in [1, its segment length]."""
    shown = f"{seg_opt} {','.join(map(str, segments))} {rate_opt} {','.join(map(str, rates))}"
    if not segments:
        parser.error(f"{seg_opt} must not be empty")
    if len(segments) != len(rates):
        parser.error(
            f"{shown}: {seg_opt} and {rate_opt} must have the same number of values, got "
            f"{len(segments)} and {len(rates)}"
        )
    if len(segments) > MAX_BRANCHES:
        parser.error(f"{shown}: at most {MAX_BRANCHES} branches are supported, got {len(segments)}")
    for w, r in zip(segments, rates, strict=True):
        if w < 1:
            parser.error(f"{shown}: every segment length must be >= 1, got {w}")
        if not 1 <= r <= w:
            parser.error(
                f"{shown}: every rate must be in [1, its segment length], got rate {r} for segment {w}"
            )


def check_heads(
    parser: argparse.ArgumentParser,
    heads: int,
    kv_heads: int | None,
    q_opt: str = "--heads",
    kv_opt: str = "--kv-heads",
) -> None:
    """``heads`` a multiple of ``kv_heads`` (None: as many as ``heads``); both come positive."""
    if kv_heads is not None and heads % kv_heads:
        parser.error(f"{q_opt} {heads} must be a multiple of {kv_opt} {kv_heads}")


def check_head_dim(parser: argparse.ArgumentParser, dim: int, opt: str) -> None:
    if not 1 <= dim <= MAX_HEAD_DIM:
        parser.error(f"{opt} must be in [1, {MAX_HEAD_DIM}] (dilated_attention's head dims), got {dim}")
