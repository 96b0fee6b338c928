"""The settings of a training run of the example GPT (``train.py``): every key can be set by a
config file or ``--key=value`` (``configurator.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import passkey
import recall
import torch
from model import ATTENTION_BACKENDS, GPTConfig

__all__ = ["DTYPES", "TrainConfig"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainConfig:
    """Every setting of a training run. The defaults are a small model that trains on a CPU."""

    # I/O (relative paths are relative to this script's directory)
    out_dir: str = "out-stdlib"
    data_dir: str = "data"
    eval_interval: int = 50
    log_interval: int = 10
    eval_iters: int = 10
    eval_only: bool = False
    always_save_checkpoint: bool = False
    init_from: str = "scratch"  # "scratch" or "resume" (from out_dir/ckpt.pt)
    # data
    dataset: str = (
        "stdlib"  # "stdlib", "passkey", "recall", or a directory of data_dir with train.bin/val.bin
    )
    max_bytes: int = 0  # stdlib: cap on the corpus size (0 = all of it)
    passkey_digits: int = 5
    recall_pairs: int = 4  # recall: key-value records in the table
    recall_queries: int = 32  # recall: queries at the end (the answers: loss and accuracy)
    recall_row: int = 8  # recall: tokens per row of the table
    recall_start_len: int = 0  # recall: first training length, doubled as answers are learned (0: full)
    recall_grow_at: float = 0.8  # recall: training answer accuracy at which the length doubles
    gradient_accumulation_steps: int = 1
    batch_size: int = 8
    block_size: int = 256
    packed: bool = False  # rows hold several documents; attention stays inside each (stdlib only)
    # model
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0  # 0 = n_head
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    attention_backend: str = "auto"  # a backend of dilated_attention, or "dense"
    segment_lengths: tuple[int, ...] = field(default_factory=lambda: (64, 128, 256))
    dilation_rates: tuple[int, ...] = field(default_factory=lambda: (1, 2, 4))
    # AdamW and the learning rate (linear warmup, then cosine decay to min_lr)
    learning_rate: float = 2e-3
    max_iters: int = 250
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 = no clipping
    decay_lr: bool = True
    warmup_iters: int = 20
    lr_decay_iters: int = 250
    min_lr: float = 2e-4
    # system
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    compile: bool = False
    gradient_checkpointing: bool = False
    ddp_backend: str = "auto"  # "auto" (nccl on GPU, gloo on CPU), "nccl", "gloo"
    context_parallel: int = 1  # processes per sequence (sequence parallelism, under torchrun)
    parallel: str = "ddp"  # with context_parallel > 1: "ddp" or "fsdp2" over the (dp, cp) mesh
    seed: int = 1337
    num_threads: int = 0  # torch.set_num_threads (0 = leave as is)
    max_minutes: float = 0.0  # stop (after a last evaluation) when training took this long; 0 = no limit
    peak_flops: float = 0.0  # per device, for the MFU; 0 = from a table of GPUs, else measured

    def validate(self) -> None:
        def positive(*names: str) -> None:
            for n in names:
                if getattr(self, n) < 1:
                    raise ValueError(f"{n} must be >= 1, got {getattr(self, n)}")

        positive(
            "eval_interval",
            "log_interval",
            "eval_iters",
            "gradient_accumulation_steps",
            "batch_size",
            "block_size",
            "passkey_digits",
            "recall_pairs",
            "recall_queries",
            "recall_row",
        )
        for n in (
            "max_iters",
            "warmup_iters",
            "lr_decay_iters",
            "max_bytes",
            "num_threads",
            "recall_start_len",
        ):
            if getattr(self, n) < 0:
                raise ValueError(f"{n} must be >= 0, got {getattr(self, n)}")
        for n in ("learning_rate", "min_lr", "weight_decay", "grad_clip", "peak_flops", "max_minutes"):
            if not math.isfinite(getattr(self, n)) or getattr(self, n) < 0:
                raise ValueError(f"{n} must be a finite number >= 0, got {getattr(self, n)}")
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                raise ValueError(f"{n} must be in [0, 1), got {getattr(self, n)}")
        if self.device != "auto":
            try:
                kind = torch.device(self.device).type
            except RuntimeError:
                kind = None
            if kind not in ("cpu", "cuda"):
                raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        try:  # the model's keys, as the model checks them, before any data is prepared
            GPTConfig(
                n_layer=self.n_layer,
                n_head=self.n_head,
                n_kv_head=self.n_kv_head,
                n_embd=self.n_embd,
                block_size=self.block_size,
                dropout=self.dropout,
                bias=self.bias,
                attention_backend=self.attention_backend,
                segment_lengths=self.segment_lengths,
                dilation_rates=self.dilation_rates,
            )
        except ValueError as e:
            raise ValueError(str(e).replace("GPTConfig.", "")) from None
        if self.init_from not in ("scratch", "resume"):
            raise ValueError(f"init_from must be 'scratch' or 'resume', got {self.init_from!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {self.dtype!r}")
        if self.ddp_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"ddp_backend must be 'auto', 'nccl' or 'gloo', got {self.ddp_backend!r}")
        if self.context_parallel < 1:
            raise ValueError(f"context_parallel must be >= 1, got {self.context_parallel}")
        if self.parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"parallel must be 'ddp' or 'fsdp2', got {self.parallel!r}")
        if self.context_parallel > 1:
            for bad, why in (
                (self.dataset != "stdlib", f"dataset={self.dataset!r} (only 'stdlib')"),
                (self.packed, "packed=True"),
                (self.attention_backend == "dense", "attention_backend='dense'"),
                (self.dropout != 0.0, f"dropout={self.dropout} (attention dropout across ranks)"),
                (self.init_from == "resume" and self.parallel == "fsdp2", "init_from='resume' with fsdp2"),
                (self.compile, "compile=True"),
            ):
                if bad:
                    raise ValueError(f"context_parallel={self.context_parallel} does not support {why}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.packed and self.dataset == "passkey":
            raise ValueError("packed=True needs a corpus of documents (dataset='stdlib'), not 'passkey'")
        if self.dataset == "passkey" and self.block_size < passkey.min_seq_len(self.passkey_digits):
            raise ValueError(
                f"block_size {self.block_size} is too short for the passkey task "
                f"(at least {passkey.min_seq_len(self.passkey_digits)})"
            )
        if self.dataset == "recall":
            recall.check_shape(self.block_size, self.recall_pairs, self.recall_queries, self.recall_row)
            if not 0.0 < self.recall_grow_at <= 1.0:
                raise ValueError(f"recall_grow_at must be in (0, 1], got {self.recall_grow_at!r}")
