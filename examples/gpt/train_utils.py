"""What the example GPT's trainer (``train.py``) uses besides its loop: the device, dtype and peak
FLOP/s, the batches, the learning-rate schedule, and the evaluation."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import context_parallel
import numpy as np
import passkey
import recall
import torch
import torch.distributed as dist
from prepare import load_meta, token_dtype
from train_config import TrainConfig

from dilated_attention import flops, hardware

logger = logging.getLogger("train")

# ---------------------------------------------------------------------------------------------
# Hardware: device, dtype, peak FLOP/s
# ---------------------------------------------------------------------------------------------


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} was asked for, but CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device=cpu or "
                f"--device=auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA devices")
        if local_rank is not None:
            device = torch.device("cuda", local_rank)
        elif device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    return device


def auto_dtype(device: torch.device) -> torch.dtype:
    """The training dtype for ``dtype="auto"``: the package's recommendation for ``device``
    (float32 on CPU; on GPUs bfloat16 from sm80 on, float16 on sm7x, float32 before)."""
    return hardware.recommended_dtype(device)


# Dense bf16/fp16 tensor-core peaks (no sparsity), FLOP/s.
GPU_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("4090", 165e12),
    ("3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def peak_flops(device: torch.device, dtype: torch.dtype, given: float) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the number comes from."""
    if given > 0:
        return given, "given"
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, spec_flops in GPU_PEAK_FLOPS:
            if key in name:
                return spec_flops, f"{name} {dtype} spec"
    n = 4096 if device.type == "cuda" else 1024
    name = str(dtype).replace("torch.", "")
    return measure_peak(device, dtype), f"{name} {n}x{n} matmul measured (at the start; again if exceeded)"


def measure_peak(device: torch.device, dtype: torch.dtype) -> float:
    """The FLOP/s of an ``n x n`` matmul in ``dtype`` (n = 4096 on a GPU, 1024 on a CPU): the best
    of three medians, since other work on the machine only ever slows a measurement down. A peak
    measured while the machine was busy is too low; the trainer measures again when the work
    itself runs faster than it (an MFU above 100%)."""
    n = 4096 if device.type == "cuda" else 1024
    return max(flops.matmul_flops(device, dtype, n=n) for _ in range(3))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


class Batches:
    """Random batches of ``block_size`` tokens: x (B, T) inputs, y (B, T) targets (-1 = ignored),
    and, with ``packed``, doc_starts (B, T) bool (else None).

    Packed documents: a row is filled with pieces of documents (the corpus's files) drawn at
    random, each a window of one document at a random offset, of a random length between
    ``block_size // 8`` and ``block_size // 2`` tokens (less where the document or the row ends), so
    a row holds about four documents. ``doc_starts`` marks where each begins; the model attends
    within each document only, and the target of a document's last token (which would be the next
    document's first token) is -1, ignored by the loss.
    """

    def __init__(self, cfg: TrainConfig, data_dir: Path, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        if cfg.dataset == "passkey":
            self.vocab_size, self.tokenizer, self.files = 256, "bytes", {}
            return
        if cfg.dataset == "recall":
            self.vocab_size, self.tokenizer, self.files = recall.VOCAB_SIZE, "recall", {}
            return
        meta = load_meta(data_dir)
        self.vocab_size, self.tokenizer = int(meta["vocab_size"]), meta.get("tokenizer", "bytes")
        self.np_dtype = np.dtype(meta.get("dtype", token_dtype(self.vocab_size).name))
        self.files = {split: data_dir / f"{split}.bin" for split in ("train", "val")}
        self.docs = {}
        if cfg.packed:
            for split in ("train", "val"):
                path = data_dir / f"{split}_docs.npy"
                if not path.exists():
                    raise FileNotFoundError(f"packed=True: {path} (document offsets) does not exist")
                self.docs[split] = np.load(path)
        for split, path in self.files.items():
            if not path.exists():
                raise FileNotFoundError(f"dataset {cfg.dataset!r}: {path} does not exist")
            n = path.stat().st_size // self.np_dtype.itemsize
            if n <= cfg.block_size:
                raise ValueError(
                    f"dataset {cfg.dataset!r}: {split} split has {n} tokens, fewer than "
                    f"block_size + 1 = {cfg.block_size + 1}"
                )

    def get(
        self, split: str, generator: torch.Generator, shape: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A batch ``(x, y, doc_starts)``; ``shape`` ``(batch, length)`` of a recall batch (the
        length curriculum's), default ``(batch_size, block_size)``."""
        cfg = self.cfg
        if cfg.dataset == "passkey":
            x, y, _ = passkey.passkey_batch(cfg.batch_size, cfg.block_size, cfg.passkey_digits, generator)
        elif cfg.dataset == "recall":
            shape = (cfg.batch_size, cfg.block_size) if shape is None else shape
            x, y, _, _ = recall.recall_batch(
                *shape, cfg.recall_pairs, cfg.recall_queries, cfg.recall_row, generator
            )
        else:
            # A new memmap every batch: numpy's memmap otherwise keeps growing resident memory.
            data = np.memmap(self.files[split], dtype=self.np_dtype, mode="r")
            ix = torch.randint(len(data) - cfg.block_size, (cfg.batch_size,), generator=generator)
            x = torch.stack(
                [torch.from_numpy(data[i : i + cfg.block_size].astype(np.int64)) for i in ix.tolist()]
            )
            y = torch.stack(
                [torch.from_numpy(data[i + 1 : i + 1 + cfg.block_size].astype(np.int64)) for i in ix.tolist()]
            )
        starts = None
        if cfg.packed:
            x, y, starts = self.packed_rows(data, self.docs[split], generator)
        if self.device.type == "cuda":
            x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
        starts = None if starts is None else starts.to(self.device)
        return x.to(self.device), y.to(self.device), starts

    def packed_rows(
        self, data: np.ndarray, docs: np.ndarray, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, y (B, T) and doc_starts (B, T) of rows packed with document pieces (class doc)."""
        B, T = self.cfg.batch_size, self.cfg.block_size
        ends = np.append(docs[1:], len(data))
        x = np.zeros((B, T), dtype=np.int64)
        y = np.full((B, T), -1, dtype=np.int64)
        starts = np.zeros((B, T), dtype=bool)

        def draw(lo: int, hi: int) -> int:  # uniform in [lo, hi)
            return int(torch.randint(lo, hi, (1,), generator=generator))

        for b in range(B):
            t = 0
            while t < T:
                d = draw(0, len(docs))
                lo, hi = int(docs[d]), int(ends[d])
                if hi - lo < 2:
                    continue
                n = min(T - t, draw(max(1, T // 8), max(2, T // 2 + 1)), hi - lo - 1)
                off = lo + draw(0, hi - lo - n)  # tokens [off, off + n], all of document d
                x[b, t : t + n] = data[off : off + n]
                y[b, t : t + n - 1] = data[off + 1 : off + n]  # y[b, t + n - 1] stays -1
                starts[b, t] = True
                t += n
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(starts)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup for ``warmup_iters``, then cosine decay to ``min_lr`` at ``lr_decay_iters``."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    span = max(cfg.lr_decay_iters - cfg.warmup_iters, 1)
    ratio = (it - cfg.warmup_iters) / span
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def backend_in_use(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The name of what computes the attention, as the backend layer chooses it (logs any fallback)."""
    if cfg.attention_backend == "dense":
        return "dense (torch sdpa)"
    from dilated_attention.backends import select_backend

    D = cfg.n_embd // cfg.n_head
    q = torch.zeros(1, cfg.block_size, cfg.n_head, D, device=device, dtype=dtype)
    k = torch.zeros(1, cfg.block_size, cfg.n_kv_head or cfg.n_head, D, device=device, dtype=dtype)
    impl = select_backend(cfg.attention_backend, q, k, dropout_p=cfg.dropout)
    name = getattr(impl, "name", type(impl).__name__)
    return name if name == cfg.attention_backend else f"{name} (asked: {cfg.attention_backend})"


def check_same_attention(config: dict[str, Any], saved: dict[str, Any]) -> None:
    """A ValueError when the attention pattern asked for differs from the checkpoint's: its weights
    were trained for that pattern (the backend may change: it computes the same function)."""
    dense, saved_dense = config["attention_backend"] == "dense", saved["attention_backend"] == "dense"
    if dense != saved_dense:
        raise ValueError(
            f"resume: the checkpoint was trained with {'dense' if saved_dense else 'dilated'} attention, "
            f"the config asks for {'dense' if dense else 'dilated'} attention"
        )
    if dense:
        return
    asked = (list(config["segment_lengths"]), list(config["dilation_rates"]))
    had = (list(saved["segment_lengths"]), list(saved["dilation_rates"]))
    if asked != had:
        raise ValueError(
            f"resume: segment_lengths={asked[0]}, dilation_rates={asked[1]} differ from the checkpoint's "
            f"segment_lengths={had[0]}, dilation_rates={had[1]}; resume with the checkpoint's pattern "
            f"or train from scratch"
        )


@torch.no_grad()
def estimate_loss(
    model: torch.nn.Module, batches: Batches, cfg: TrainConfig, ctx: Any, mesh: Any = None
) -> dict[str, float]:
    """Mean loss of ``eval_iters`` batches of each split (the same batches at every evaluation);
    for the passkey task also the accuracy on the key's digits, for recall on the answers. With
    context parallelism (``mesh``, see ``context_parallel.py``) every rank evaluates its part and
    the losses are averaged over all ranks."""
    out: dict[str, float] = {}
    model.eval()
    for s, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(cfg.seed + 1000 + s)
        losses, digit, key, answer = [], [], [], []
        for _ in range(cfg.eval_iters):
            x, y, doc_starts = batches.get(split, gen)
            if mesh is not None:
                x, y = context_parallel.select(x, mesh), context_parallel.select(y, mesh)
            with ctx:
                logits, loss = model(x, y, doc_starts=doc_starts)
            if mesh is not None:
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= dist.get_world_size()
            losses.append(loss.item())
            if cfg.dataset == "passkey":
                d, k = passkey.answer_accuracy(logits.float(), y)
                digit.append(d)
                key.append(k)
            elif cfg.dataset == "recall":
                answer.append(recall.answer_accuracy(logits, y))
        out[split] = float(np.mean(losses))
        if digit:
            out[f"{split}_digit_acc"] = float(np.mean(digit))
            out[f"{split}_key_acc"] = float(np.mean(key))
        if answer:
            out[f"{split}_answer_acc"] = float(np.mean(answer))
    model.train()
    return out


def log_reachable(cfg: TrainConfig, gptconf: Any, log: Any) -> None:
    """For the passkey and recall tasks, the share of the samples that this attention and depth
    can answer at all (the ceiling of the accuracy)."""
    if cfg.dataset == "passkey" and cfg.block_size <= 8192:
        frac = passkey.reachable_fraction(
            cfg.block_size,
            cfg.n_layer,
            cfg.n_head,
            gptconf.segment_lengths,
            gptconf.dilation_rates,
            dense=cfg.attention_backend == "dense",
            n_digits=cfg.passkey_digits,
        )
        log(
            f"passkey: the answer can read the key in {frac:.0%} of samples with this attention and "
            f"{cfg.n_layer} layers (the ceiling of the key accuracy)"
        )

    if cfg.dataset == "recall" and cfg.block_size <= 8192:
        frac = recall.reachable_fraction(
            cfg.block_size,
            cfg.n_layer,
            cfg.n_head,
            gptconf.segment_lengths,
            gptconf.dilation_rates,
            dense=cfg.attention_backend == "dense",
            n_pairs=cfg.recall_pairs,
            n_queries=cfg.recall_queries,
            row=cfg.recall_row,
        )
        log(
            f"recall: {frac:.0%} of the queries can read their record with this attention and {cfg.n_layer} layers"
        )
