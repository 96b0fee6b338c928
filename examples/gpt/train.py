"""Train the example GPT (nanoGPT's ``train.py``, with the attention as a config key).

Single process, from this directory or from anywhere (paths are relative to this script)::

    python train.py config/train_stdlib.py
    python train.py config/train_stdlib.py --attention_backend=sdpa --batch_size=8
    python examples/gpt/train.py examples/gpt/config/train_stdlib.py

Several processes (DDP; gloo on CPU, nccl on GPU)::

    torchrun --standalone --nproc_per_node=2 train.py config/train_stdlib.py

Every key of ``TrainConfig`` can be set by a config file or ``--key=value`` (see
``configurator.py``); an unknown key or a value of the wrong type is an error.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dilated_attention import flops, hardware

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import configurator
import passkey
import recall
from model import ATTENTION_BACKENDS, GPT, GPTConfig
from prepare import load_meta, prepare_stdlib, token_dtype

logger = logging.getLogger("train")

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
        if self.init_from not in ("scratch", "resume"):
            raise ValueError(f"init_from must be 'scratch' or 'resume', got {self.init_from!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {self.dtype!r}")
        if self.ddp_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"ddp_backend must be 'auto', 'nccl' or 'gloo', got {self.ddp_backend!r}")
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
    # The best of three medians: other work on the machine only ever slows a measurement down, and
    # a peak measured too low would put the MFU above 100%.
    best = max(flops.matmul_flops(device, dtype, n=n) for _ in range(3))
    return best, f"{name} {n}x{n} matmul measured once at the start"


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
def estimate_loss(model: torch.nn.Module, batches: Batches, cfg: TrainConfig, ctx: Any) -> dict[str, float]:
    """Mean loss of ``eval_iters`` batches of each split (the same batches at every evaluation);
    for the passkey task also the accuracy on the key's digits, for recall on the answers."""
    out: dict[str, float] = {}
    model.eval()
    for s, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(cfg.seed + 1000 + s)
        losses, digit, key, answer = [], [], [], []
        for _ in range(cfg.eval_iters):
            x, y, doc_starts = batches.get(split, gen)
            with ctx:
                logits, loss = model(x, y, doc_starts=doc_starts)
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


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train as the arguments say; returns a summary (losses, evaluations, backend, paths)."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = configurator.load_config(TrainConfig, argv, base_dir=HERE)
    cfg.validate()
    out_dir = (HERE / cfg.out_dir).resolve()
    data_root = (HERE / cfg.data_dir).resolve()

    # Processes: DDP under torchrun, else one.
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        rank, local_rank, world = (
            int(os.environ["RANK"]),
            int(os.environ["LOCAL_RANK"]),
            int(os.environ["WORLD_SIZE"]),
        )
        device = resolve_device(cfg.device, local_rank if cfg.device in ("auto", "cuda") else None)
        backend = (
            cfg.ddp_backend if cfg.ddp_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
        # gradient_accumulation_steps counts micro-batches per iteration over all processes
        # (nanoGPT's convention); fewer than the processes means one per process.
        if cfg.gradient_accumulation_steps > world and cfg.gradient_accumulation_steps % world != 0:
            raise ValueError(
                f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be a multiple "
                f"of the number of processes ({world}), or at most {world}"
            )
        grad_accum = max(1, cfg.gradient_accumulation_steps // world)
    else:
        rank, world, grad_accum = 0, 1, cfg.gradient_accumulation_steps
        device = resolve_device(cfg.device)
    master = rank == 0
    if not master:

        def log(*_):
            return None

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    tokens_per_iter = grad_accum * world * cfg.batch_size * cfg.block_size
    torch.manual_seed(cfg.seed + rank)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = auto_dtype(device) if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    ctx = (
        nullcontext() if ptdtype == torch.float32 else torch.autocast(device_type=device.type, dtype=ptdtype)
    )

    # Data
    if cfg.dataset == "stdlib":
        if master:
            prepare_stdlib(data_root / "stdlib", max_bytes=cfg.max_bytes)
        if ddp:
            dist.barrier()
    batches = Batches(cfg, data_root / cfg.dataset, device)
    data_gen = torch.Generator().manual_seed(cfg.seed + rank)

    # Model
    model_args = {
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_kv_head": cfg.n_kv_head,
        "n_embd": cfg.n_embd,
        "block_size": cfg.block_size,
        "bias": cfg.bias,
        "vocab_size": batches.vocab_size,
        "dropout": cfg.dropout,
        "attention_backend": cfg.attention_backend,
        "segment_lengths": cfg.segment_lengths,
        "dilation_rates": cfg.dilation_rates,
        "gradient_checkpointing": cfg.gradient_checkpointing,
    }
    iter_num, best_val_loss, checkpoint = 0, 1e9, None
    checkpoint_peak: tuple[float, str] | None = None
    resumed_len = 0  # the recall curriculum's training length in the checkpoint
    ckpt_path = out_dir / "ckpt.pt"
    if cfg.init_from == "resume":
        if not ckpt_path.exists():
            raise FileNotFoundError(f"init_from='resume' but there is no checkpoint at {ckpt_path}")
        checkpoint = torch.load(ckpt_path, map_location=device, weights_only=True)
        check_same_attention(model_args, checkpoint["model_args"])
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "bias", "vocab_size"):
            if model_args[k] != checkpoint["model_args"][k] and not (k == "n_kv_head" and model_args[k] == 0):
                log(
                    f"resume: {k} = {checkpoint['model_args'][k]} from the checkpoint (config said {model_args[k]})"
                )
            model_args[k] = checkpoint["model_args"][k]
        if cfg.block_size != model_args["block_size"]:
            raise ValueError(
                f"resume: block_size {cfg.block_size} differs from the checkpoint's "
                f"{model_args['block_size']}"
            )
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        resumed_len = int(checkpoint.get("recall_seq_len", 0))
        if "peak_flops" in checkpoint:  # the MFU keeps the peak the run started with
            checkpoint_peak = (float(checkpoint["peak_flops"]), str(checkpoint["peak_flops_source"]))
    gptconf = GPTConfig(**model_args)
    model = GPT(gptconf)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    model.to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=(ptdtype == torch.float16))
    optimizer = model.configure_optimizers(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type
    )
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        rng = checkpoint.get("rng", {})
        if world == 1 and rng:  # a single process continues its random streams exactly
            torch.set_rng_state(rng["torch"].cpu())
            data_gen.set_state(rng["data"].cpu())
            if device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"].cpu(), device)
        else:  # several processes: fresh streams per rank and position
            data_gen.manual_seed(cfg.seed + rank + 100003 * iter_num)
        checkpoint = None  # free memory
    raw_model = model
    if cfg.compile:
        log("compiling the model (torch.compile)...")
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    backend_name = backend_in_use(cfg, device, ptdtype)
    attn_note = (
        ""
        if cfg.attention_backend == "dense"
        else f" segments {list(gptconf.segment_lengths)} rates {list(gptconf.dilation_rates)}"
    )
    saved_peak = checkpoint_peak if cfg.peak_flops == 0 else None
    peak, peak_src = saved_peak or peak_flops(device, ptdtype, cfg.peak_flops)
    peak_note = f"{peak_src}, kept in the checkpoint" if saved_peak else peak_src
    heads = f"{gptconf.n_head} heads" + (
        f" ({gptconf.n_kv_head} kv)" if gptconf.n_kv_head != gptconf.n_head else ""
    )
    log(
        f"model {raw_model.get_num_params() / 1e6:.2f}M params | {gptconf.n_layer} layers, {heads}, "
        f"{gptconf.n_embd} dims, block {gptconf.block_size} | attention {backend_name}{attn_note}"
    )
    log(
        f"device {device} x{world} | dtype {str(ptdtype).replace('torch.', '')} | {tokens_per_iter:,} tokens/iter | "
        f"MFU peak {peak / 1e12:.3f} TFLOP/s per device ({peak_note})"
    )

    if cfg.dataset == "passkey" and master and cfg.block_size <= 8192:
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

    def save_checkpoint() -> None:
        state = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "model_args": gptconf.to_dict(),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
            "rng": {"torch": torch.get_rng_state(), "data": data_gen.get_state()},
            "peak_flops": peak,
            "peak_flops_source": peak_src,
        }
        if curriculum is not None:
            state["recall_seq_len"] = curriculum.seq_len
        if device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(device)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "ckpt.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)
        log(f"saved checkpoint to {ckpt_path}")

    if cfg.dataset == "recall" and master and cfg.block_size <= 8192:
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

    curriculum = None  # the recall task's training length (recall.LengthCurriculum)
    if cfg.dataset == "recall":
        curriculum = recall.LengthCurriculum(
            cfg.block_size,
            cfg.batch_size,
            start=resumed_len or cfg.recall_start_len,
            grow_at=cfg.recall_grow_at,
            row=cfg.recall_row,
            min_len=recall.min_seq_len(cfg.recall_pairs, cfg.recall_queries, cfg.recall_row),
        )
        if curriculum.seq_len < cfg.block_size:
            log(
                f"recall: training starts at {curriculum.seq_len} tokens (batch {curriculum.shape()[0]}) and "
                f"doubles when the training answer accuracy reaches {cfg.recall_grow_at:.0%}"
            )

    summary: dict[str, Any] = {
        "losses": [],
        "evals": [],
        "backend": backend_name,
        "out_dir": str(out_dir),
        "ckpt_path": str(ckpt_path),
        "config": cfg,
    }
    t_start = time.time()
    t0 = time.time()
    local_iter, tok_s = 0, 0.0
    window_time, window_iters, window_flops = 0.0, 0, 0.0  # the iterations since the last progress line
    train_seconds, out_of_time = 0.0, False  # time in training steps, evaluations excluded
    tokens_seen = 0  # training tokens, all processes
    while True:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if (iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters or out_of_time) and master:
            losses = estimate_loss(model, batches, cfg, ctx)
            extra = "".join(f" | {k} {v:.3f}" for k, v in losses.items() if k.endswith("acc"))
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{extra}")
            seq_len = cfg.block_size if curriculum is None else curriculum.seq_len
            summary["evals"].append(
                {"iter": iter_num, "seconds": train_seconds, "seq_len": seq_len, **losses}
            )
            if losses["val"] < best_val_loss or cfg.always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0:
                    save_checkpoint()
            t0 = time.time()  # the evaluation does not count in the next iteration's time
        if cfg.eval_only or iter_num >= cfg.max_iters or out_of_time:
            break

        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            if ddp:  # synchronise gradients only at the last micro step
                model.require_backward_grad_sync = micro == grad_accum - 1
            x, y, doc_starts = batches.get(
                "train", data_gen, None if curriculum is None else curriculum.shape()
            )
            with ctx:
                logits, loss = model(x, y, doc_starts=doc_starts)
                loss = loss / grad_accum
            tokens_seen += x.numel() * world
            loss_sum += loss.detach()
            scaler.scale(loss).backward()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if curriculum is not None and curriculum.seq_len < cfg.block_size:
            acc = torch.tensor([recall.answer_accuracy(logits.detach(), y)], device=device)
            if ddp:  # every process grows at the same step
                dist.all_reduce(acc)
                acc /= world
            if curriculum.update(float(acc.item())) and master:
                log(f"step {iter_num}: recall answers learned; training length {curriculum.seq_len}")

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if local_iter >= 2:  # the first iterations (allocation, compilation) are not timed
            window_time, window_iters = window_time + dt, window_iters + 1
            # The FLOPs of the step just run, at its own length: with the recall curriculum the
            # sequences are shorter (and more) than block_size, and attention costs less per token.
            step_batch, step_len = x.shape
            window_flops += raw_model.flops_per_sequence(step_len) * step_batch * grad_accum * world
        train_seconds += dt
        if iter_num % cfg.log_interval == 0 and master:
            lossf = loss_sum.item()
            summary["losses"].append((iter_num, lossf))
            timing = "-- ms/iter | -- tok/s | mfu --"
            if window_iters:  # averages over the iterations since the last progress line
                per_iter = window_time / window_iters
                tok_s = tokens_per_iter / per_iter
                mfu = window_flops / (window_time * peak * world)
                timing = f"{per_iter * 1000:.0f} ms/iter | {tok_s:,.0f} tok/s | mfu {mfu * 100:.2f}%"
            window_time, window_iters, window_flops = 0.0, 0, 0.0
            log(f"iter {iter_num}: loss {lossf:.4f} | lr {lr:.2e} | {timing} | attn {backend_name}")
        iter_num += 1
        local_iter += 1
        out_of_time = cfg.max_minutes > 0 and train_seconds >= 60 * cfg.max_minutes
        if ddp and cfg.max_minutes > 0:  # every process stops at the same step, as the master says
            flag = torch.tensor([float(out_of_time)], device=device)
            dist.broadcast(flag, 0)
            out_of_time = bool(flag.item())

    summary.update(
        iter_num=iter_num,
        best_val_loss=best_val_loss,
        seconds=time.time() - t_start,
        train_seconds=train_seconds,
        tokens=tokens_seen,
    )
    if ddp:
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        main()
    except (configurator.ConfigError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
