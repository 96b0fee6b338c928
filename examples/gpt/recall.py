"""Multi-query associative recall: a long-range lookup task for the example GPT.

A sequence is a table of fixed-width rows. ``n_pairs`` rows, at random places, are records
``k v v v v v v v`` (a key, then its value repeated); the other rows are blank. At the end come
``n_queries`` keys of the table (drawn with replacement), one token each::

    row 0      row 1              row 2 ...                                   queries
    _ _ _ _ .. k7 v3 v3 v3 v3 ..  _ _ _ _ ..  ...  k2 v9 v9 v9 v9 ..  ...  | k2 k7 k7 k2 ...

The target of each query is its key's value (not the next input: the values never appear after
the table, so a query cannot copy an earlier answer); only these targets count in the loss and
the accuracy. Nothing before a query tells its value but the record with the same key, anywhere
in the sequence.

Tokens: keys ``[0, N_KEYS)``, values ``[N_KEYS, N_KEYS + N_VALUES)``, then the blank. The rows
are as wide as the shortest segment of the branches the example uses, so that one layer of that
branch can gather a record's key into its value positions, and the value is repeated so that the
row has every phase of the dilated branches (rows wider than the largest rate): a second layer
can then read the record from any query, if the attention reaches that far
(``reachable_fraction``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import passkey
import torch

N_KEYS = 256
N_VALUES = 64
BLANK = N_KEYS + N_VALUES  # the filler token
VOCAB_SIZE = N_KEYS + N_VALUES + 1


def check_shape(seq_len: int, n_pairs: int, n_queries: int, row: int) -> None:
    """Raise ``ValueError`` unless ``seq_len`` holds ``n_pairs`` records of ``row`` tokens and
    ``n_queries`` queries, and the keys suffice."""
    for name, v in (("seq_len", seq_len), ("n_pairs", n_pairs), ("n_queries", n_queries), ("row", row)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if row < 2:
        raise ValueError(f"row must be >= 2 (a key and a value), got {row}")
    if n_pairs > N_KEYS:
        raise ValueError(f"n_pairs must be <= {N_KEYS} (the number of distinct keys), got {n_pairs}")
    if seq_len < min_seq_len(n_pairs, n_queries, row):
        raise ValueError(
            f"seq_len {seq_len} is too short for {n_pairs} recall records in rows of {row} and "
            f"{n_queries} queries (at least {min_seq_len(n_pairs, n_queries, row)})"
        )


def min_seq_len(n_pairs: int, n_queries: int, row: int) -> int:
    """The shortest sequence: ``n_pairs`` records and the queries, each region whole rows."""
    return n_pairs * row + -(-n_queries // row) * row


def recall_batch(
    batch_size: int,
    seq_len: int,
    n_pairs: int = 16,
    n_queries: int = 64,
    row: int = 8,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, record_pos, query_pos)`` for ``batch_size`` sequences of ``seq_len`` tokens.

    x (B, T) inputs; y (B, T) targets, ``-1`` (ignored) except at the queries (the last
    ``n_queries`` tokens, keys of the table drawn with replacement), whose target is the key's
    value; record_pos (B, n_queries) the position of the record that the query at query_pos
    (B, n_queries) asks for. The values are never inputs after the table, so a query cannot copy
    an earlier query's answer.
    """
    check_shape(seq_len, n_pairs, n_queries, row)
    B, T = batch_size, seq_len
    n_rows = (T - -(-n_queries // row) * row) // row  # rows before the queries' rows
    gen = generator
    x = torch.full((B, T), BLANK, dtype=torch.int64)
    keys = torch.rand(B, N_KEYS, generator=gen).argsort(dim=1)[:, :n_pairs]  # distinct per sequence
    values = N_KEYS + torch.randint(N_VALUES, (B, n_pairs), generator=gen)
    rows = torch.rand(B, n_rows, generator=gen).argsort(dim=1)[:, :n_pairs]  # where the records go
    b = torch.arange(B)[:, None]
    x[b, rows * row] = keys
    for j in range(1, row):
        x[b, rows * row + j] = values
    asked = torch.randint(n_pairs, (B, n_queries), generator=gen)  # which record each query asks for
    query_pos = (T - n_queries + torch.arange(n_queries))[None, :].expand(B, -1)
    x[b, query_pos] = keys.gather(1, asked)
    y = torch.full_like(x, -1)
    y[b, query_pos] = values.gather(1, asked)
    return x, y, (rows * row).gather(1, asked), query_pos


def warmup_shape(
    it: int, warmup_iters: int, block_size: int, batch_size: int, n_pairs: int, n_queries: int, row: int
) -> tuple[int, int]:
    """``(batch_size, seq_len)`` of training step ``it`` under sequence-length warmup: the
    sequences grow linearly from an eighth of ``block_size`` (or the shortest that holds the task)
    to ``block_size`` over ``warmup_iters`` steps, whole rows, and the batch shrinks so that a step
    has about as many tokens as a full one. ``warmup_iters=0``: always full length."""
    if warmup_iters <= 0 or it >= warmup_iters:
        return batch_size, block_size
    shortest = max(min_seq_len(n_pairs, n_queries, row), block_size // 8)
    seq_len = shortest + (block_size - shortest) * it // warmup_iters
    seq_len = min(max(seq_len // row * row, shortest), block_size)
    return max(batch_size * block_size // seq_len, 1), seq_len


def step_shape(cfg: Any, it: int) -> tuple[int, int]:
    """``warmup_shape`` of step ``it`` for a training config (``block_size``, ``batch_size`` and the
    ``recall_*`` keys of ``train.TrainConfig``)."""
    return warmup_shape(
        it,
        cfg.recall_len_warmup,
        cfg.block_size,
        cfg.batch_size,
        cfg.recall_pairs,
        cfg.recall_queries,
        cfg.recall_row,
    )


def reachable_fraction(
    seq_len: int,
    n_layer: int,
    n_head: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    dense: bool = False,
    n_pairs: int = 16,
    n_queries: int = 64,
    row: int = 8,
    samples: int = 8,
    seed: int = 0,
) -> float:
    """Fraction of queries whose answer position can read, after ``n_layer`` layers, both the key
    and a value of the record it asks for: the ceiling of the accuracy beyond guessing."""
    field = passkey.receptive_field(seq_len, n_layer, n_head, segment_lengths, dilation_rates, dense)
    gen = torch.Generator().manual_seed(seed)
    _, _, rec, qpos = recall_batch(samples, seq_len, n_pairs, n_queries, row, gen)
    key_ok = field[qpos, rec]  # (B, n_pairs)
    value_ok = torch.stack([field[qpos, rec + j] for j in range(1, row)]).any(dim=0)
    return float((key_ok & value_ok).float().mean())


def answer_accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of answers (targets ``>= 0``) that the greedy prediction gets right."""
    mask = y >= 0
    return ((logits.argmax(dim=-1) == y) & mask).sum().item() / max(int(mask.sum().item()), 1)
