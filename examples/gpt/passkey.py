"""Passkey retrieval: a long-range task that shows what long context buys.

A random key of ``n_digits`` digits is hidden at a random depth in thousands of bytes of
repetitive filler text, and asked for at the very end::

    The grass is green. The sky is blue. ... The pass key is 68041. Remember it. 68041 is the
    pass key. ... Here we go. There and back again. What is the pass key? The pass key is 68041

Tokens are bytes (vocabulary 256). Only the digits of the final answer are targets: nothing
before them predicts them except the key itself, so a model can answer only if the answer's
positions can read the key's. With dilated attention whose largest segment covers the whole
sequence this is possible; with short segments only (e.g. ``segment_lengths=[64, 256]`` on 2048
tokens, the segment lengths dividing each other) the answer can never read a key outside its
own segment, in any number of layers, and the accuracy stays at chance (10% a digit) for keys
hidden further back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FILLER = (
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
)
QUESTION = "What is the pass key? The pass key is "


def key_sentence(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


@dataclass
class PasskeySample:
    """``tokens`` (seq_len + 1,) int64 bytes; the key's digits start at ``key_pos`` and the
    answer's (the last ``n_digits`` tokens) at ``answer_pos``."""

    tokens: torch.Tensor
    key: str
    key_pos: int
    answer_pos: int


def min_seq_len(n_digits: int) -> int:
    """The shortest sequence that holds the key sentence, the question and the answer."""
    return len(key_sentence("0" * n_digits)) + len(QUESTION) + n_digits - 1


def passkey_sample(
    seq_len: int,
    n_digits: int = 5,
    generator: torch.Generator | None = None,
    depth: float | None = None,
) -> PasskeySample:
    """One sample of ``seq_len + 1`` tokens (inputs are ``tokens[:-1]``, targets ``tokens[1:]``).

    The key sentence starts at a sentence boundary of the filler, at a uniformly random one or,
    with ``depth`` in [0, 1], at the one nearest that fraction of the filler.
    """
    if isinstance(n_digits, bool) or not isinstance(n_digits, int) or n_digits < 1:
        raise ValueError(f"n_digits must be a positive int, got {n_digits!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < min_seq_len(n_digits):
        raise ValueError(
            f"seq_len must be an int >= {min_seq_len(n_digits)} for {n_digits} digits, got {seq_len!r}"
        )
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] or None, got {depth!r}")

    def randint(high: int) -> int:
        return int(torch.randint(high, (1,), generator=generator).item())

    key = "".join(str(randint(10)) for _ in range(n_digits))
    ks = key_sentence(key)
    n_filler = seq_len + 1 - len(ks) - len(QUESTION) - n_digits
    # Filler: the sentences in cyclic order from a random one, cut to n_filler characters.
    parts, boundaries, length, j = [], [0], 0, randint(len(FILLER))
    while length < n_filler:
        s = FILLER[j % len(FILLER)]
        parts.append(s)
        length += len(s)
        j += 1
        if length < n_filler:
            boundaries.append(length)
    filler = "".join(parts)[:n_filler]
    if depth is None:
        cut = boundaries[randint(len(boundaries))]
    else:
        cut = min(boundaries, key=lambda b: abs(b - depth * n_filler))
    text = filler[:cut] + ks + filler[cut:] + QUESTION + key
    tokens = torch.tensor(list(text.encode("ascii")), dtype=torch.int64)
    assert tokens.numel() == seq_len + 1, (tokens.numel(), seq_len + 1)
    key_pos = cut + len("The pass key is ")
    return PasskeySample(tokens=tokens, key=key, key_pos=key_pos, answer_pos=seq_len + 1 - n_digits)


def passkey_batch(
    batch_size: int,
    seq_len: int,
    n_digits: int = 5,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, key_pos)``: inputs x (B, T), targets y (B, T) that are ``-1`` (ignored) except at
    the answer's digits, and the position of each key's first digit (B,)."""
    samples = [passkey_sample(seq_len, n_digits, generator) for _ in range(batch_size)]
    tokens = torch.stack([s.tokens for s in samples])  # (B, T + 1)
    x = tokens[:, :-1].clone()
    y = torch.full_like(x, -1)
    y[:, -n_digits:] = tokens[:, -n_digits:]
    key_pos = torch.tensor([s.key_pos for s in samples], dtype=torch.int64)
    return x, y, key_pos


def attention_graph(
    seq_len: int,
    n_head: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    dense: bool = False,
) -> torch.Tensor:
    """(T, T) bool: whether position ``p`` reads position ``x`` in one causal attention layer,
    through any head (the heads are mixed by the output projection). SPEC section 2: branch
    ``(w, r)`` links ``x <= p`` of one segment whose phases agree and are some head's offset."""
    pos = torch.arange(seq_len)
    causal = pos[None, :] <= pos[:, None]
    if dense:
        return causal
    graph = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        seg, phase = pos // w, (pos % w) % r
        covered = phase < min(r, n_head)  # head h has offset h % r: offsets 0 .. min(r, H) - 1
        graph |= (seg[:, None] == seg[None, :]) & (phase[:, None] == phase[None, :]) & covered[:, None]
    return graph & causal


def receptive_field(
    seq_len: int,
    n_layer: int,
    n_head: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    dense: bool = False,
) -> torch.Tensor:
    """(T, T) bool: whether the output at ``p`` after ``n_layer`` layers can depend on the token at
    ``x`` (attention paths, plus the residual stream that keeps each position's own token)."""
    step = attention_graph(seq_len, n_head, segment_lengths, dilation_rates, dense)
    step |= torch.eye(seq_len, dtype=torch.bool)
    step_f = step.float()
    field = step_f.clone()
    for _ in range(n_layer - 1):
        field = ((field @ step_f) > 0).float()
    return field > 0


def reachable_fraction(
    seq_len: int,
    n_layer: int,
    n_head: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    dense: bool = False,
    n_digits: int = 5,
    samples: int = 200,
    seed: int = 0,
) -> float:
    """Fraction of passkey samples in which every answer digit's prediction can read the key digit
    it must copy: an upper bound on the key accuracy any trained model of that shape can reach
    (beyond guessing)."""
    field = receptive_field(seq_len, n_layer, n_head, segment_lengths, dilation_rates, dense)
    gen = torch.Generator().manual_seed(seed)
    ok = 0
    for _ in range(samples):
        s = passkey_sample(seq_len, n_digits, gen)
        # digit j of the answer is predicted at input position answer_pos - 1 + j and copies the
        # key digit at position key_pos + j
        ok += all(bool(field[s.answer_pos - 1 + j, s.key_pos + j]) for j in range(n_digits))
    return ok / samples


def answer_accuracy(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(digit_acc, key_acc)`` of greedy predictions at the target positions (teacher forced):
    the fraction of digits right, and of samples with every digit right. logits (B, T, V)."""
    mask = y >= 0  # (B, T)
    correct = (logits.argmax(dim=-1) == y) | ~mask
    digit_acc = ((logits.argmax(dim=-1) == y) & mask).sum().item() / max(int(mask.sum().item()), 1)
    key_acc = correct.all(dim=1).float().mean().item()
    return digit_acc, key_acc
