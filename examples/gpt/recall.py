"""Multi-query lookup: a long-range task for the example GPT.

A sequence is a table of fixed-width rows. ``n_pairs`` rows, at random places, are records: one
token that stands for a (key, value) pair, written ``row`` times; the other rows are blank. At the
end come ``n_queries`` keys of the table (drawn with replacement), one token each::

    row 0      row 1              row 2 ...                                  queries
    _ _ _ _ .. R72 R72 R72 R72 .. _ _ _ _ ..  ...  R25 R25 R25 R25 ..  ...  | k2 k7 k7 k2 ...

The target of each query is the value of its key's record (``R72`` stands for key 7 and value 2);
only these targets count in the loss and the accuracy. Nothing before a query tells its value but
the record with the same key, anywhere in the sequence, so a query is answered exactly when its
attention reaches that record (``reachable_fraction``): one attention hop, from the query to any
copy of the record.

Tokens: keys ``[0, N_KEYS)``, values ``[N_KEYS, N_KEYS + N_VALUES)`` (targets only, never inputs),
the records ``[RECORDS, RECORDS + N_KEYS * N_VALUES)``, then the blank. A record fills its row
(``row`` at least the largest dilation rate) so that every head phase of a dilated branch holds a
copy: a query at any position reads the record in the head whose phase covers it.

Training starts on short sequences and doubles their length each time the training answers are
learned (:class:`LengthCurriculum`): the lookup is found where records are a large part of the
sequence, and then carried to the full length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import passkey
import torch

N_KEYS = 8
N_VALUES = 8
RECORDS = N_KEYS + N_VALUES  # the first record token: RECORDS + key * N_VALUES + value
BLANK = RECORDS + N_KEYS * N_VALUES  # the filler token
VOCAB_SIZE = BLANK + 1


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
    n_pairs: int = 4,
    n_queries: int = 32,
    row: int = 8,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, record_pos, query_pos)`` for ``batch_size`` sequences of ``seq_len`` tokens.

    x (B, T) inputs; y (B, T) targets, ``-1`` (ignored) except at the queries (the last
    ``n_queries`` tokens, keys of the table drawn with replacement), whose target is the key's
    value; record_pos (B, n_queries) the first position of the record that the query at
    query_pos (B, n_queries) asks for. The keys of a sequence are distinct; the values are never
    inputs, so a query cannot copy an earlier query's answer.
    """
    check_shape(seq_len, n_pairs, n_queries, row)
    B, T = batch_size, seq_len
    n_rows = (T - -(-n_queries // row) * row) // row  # rows before the queries' rows
    gen = generator
    x = torch.full((B, T), BLANK, dtype=torch.int64)
    keys = torch.rand(B, N_KEYS, generator=gen).argsort(dim=1)[:, :n_pairs]  # distinct per sequence
    values = torch.randint(N_VALUES, (B, n_pairs), generator=gen)
    rows = torch.rand(B, n_rows, generator=gen).argsort(dim=1)[:, :n_pairs]  # where the records go
    b = torch.arange(B)[:, None]
    for j in range(row):
        x[b, rows * row + j] = RECORDS + keys * N_VALUES + values
    values = values + N_KEYS  # the answers' tokens
    asked = torch.randint(n_pairs, (B, n_queries), generator=gen)  # which record each query asks for
    query_pos = (T - n_queries + torch.arange(n_queries))[None, :].expand(B, -1)
    x[b, query_pos] = keys.gather(1, asked)
    y = torch.full_like(x, -1)
    y[b, query_pos] = values.gather(1, asked)
    return x, y, (rows * row).gather(1, asked), query_pos


class LengthCurriculum:
    """The training sequences' length: ``start`` tokens at first, doubled (up to ``block_size``)
    each time the training answers are learned, i.e. when the running mean of the training answer
    accuracy (an exponential average over about 20 steps) reaches ``grow_at``. The batch grows as
    the sequences shrink, so that a step has about as many tokens at every length.
    ``start >= block_size`` (or 0): always full length.

    >>> c = LengthCurriculum(2048, 2, start=128, grow_at=0.8)
    >>> c.shape()
    (32, 128)
    """

    def __init__(
        self,
        block_size: int,
        batch_size: int,
        start: int = 0,
        grow_at: float = 0.8,
        row: int = 1,
        min_len: int = 1,
    ) -> None:
        if not 0.0 < grow_at <= 1.0:
            raise ValueError(f"grow_at must be in (0, 1], got {grow_at!r}")
        self.block_size, self.batch_size, self.grow_at = block_size, batch_size, grow_at
        self.row, self.min_len = row, min_len
        self.seq_len = self._whole_rows(block_size if start <= 0 else start)
        self.mean_acc = 0.0

    def _whole_rows(self, n: int) -> int:
        """``n`` rounded up to whole rows, at least ``min_len``, at most ``block_size``."""
        return min(max(-(-n // self.row) * self.row, self.min_len), self.block_size)

    def shape(self) -> tuple[int, int]:
        """``(batch_size, seq_len)`` of the next training step."""
        return max(self.batch_size * self.block_size // self.seq_len, 1), self.seq_len

    def update(self, answer_acc: float) -> bool:
        """Takes a training step's answer accuracy; ``True`` when the sequences grow."""
        if not math.isfinite(answer_acc):
            raise ValueError(f"answer_acc must be finite, got {answer_acc!r}")
        self.mean_acc = 0.95 * self.mean_acc + 0.05 * answer_acc
        if self.mean_acc < self.grow_at or self.seq_len >= self.block_size:
            return False
        self.seq_len = self._whole_rows(2 * self.seq_len)
        self.mean_acc = 0.0
        return True


def reachable_fraction(
    seq_len: int,
    n_layer: int,
    n_head: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    dense: bool = False,
    n_pairs: int = 4,
    n_queries: int = 32,
    row: int = 8,
    samples: int = 8,
    seed: int = 0,
) -> float:
    """Fraction of queries whose position can read, after ``n_layer`` layers, a copy of the record
    it asks for: the ceiling of the accuracy beyond guessing."""
    field = passkey.receptive_field(seq_len, n_layer, n_head, segment_lengths, dilation_rates, dense)
    gen = torch.Generator().manual_seed(seed)
    _, _, rec, qpos = recall_batch(samples, seq_len, n_pairs, n_queries, row, gen)
    copy_ok = torch.stack([field[qpos, rec + j] for j in range(row)]).any(dim=0)
    return float(copy_ok.float().mean())


def answer_accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of answers (targets ``>= 0``) that the greedy prediction gets right."""
    mask = y >= 0
    return ((logits.argmax(dim=-1) == y) & mask).sum().item() / max(int(mask.sum().item()), 1)
