"""Train the example GPT (nanoGPT's ``train.py``, with the attention as a config key).

Single process, from this directory or from anywhere (paths are relative to this script)::

    python train.py config/train_stdlib.py
    python train.py config/train_stdlib.py --attention_backend=sdpa --batch_size=8
    python examples/gpt/train.py examples/gpt/config/train_stdlib.py

Several processes (DDP; gloo on CPU, nccl on GPU)::

    torchrun --standalone --nproc_per_node=2 train.py config/train_stdlib.py

Sequence parallelism: each sequence split over ``--context_parallel`` processes of a
("dp", "cp") mesh, DDP or FSDP2 (``--parallel=fsdp2``) over the whole mesh (``context_parallel.py``)::

    torchrun --standalone --nproc_per_node=4 train.py config/train_stdlib.py --context_parallel=2

Every key of ``TrainConfig`` can be set by a config file or ``--key=value`` (see
``configurator.py``); an unknown key or a bad value is an error that names the key (exit status 2).
``python train.py --help`` lists the keys and their defaults.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import typing
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import configurator
import context_parallel
import recall
from model import GPT, GPTConfig
from prepare import prepare_stdlib
from train_config import DTYPES, TrainConfig
from train_utils import (
    Batches,
    auto_dtype,
    backend_in_use,
    check_same_attention,
    estimate_loss,
    get_lr,
    log_reachable,
    measure_peak,
    peak_flops,
    resolve_device,
)

__all__ = [
    "DTYPES",
    "Batches",
    "TrainConfig",
    "auto_dtype",
    "main",
    "parse_config",
    "resolve_device",
    "usage",
]

logger = logging.getLogger("train")

USAGE = "usage: train.py [-h] [CONFIG_FILE ...] [--key=value ...]"


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def usage() -> str:
    """The help text: every key of ``TrainConfig`` with its default and type."""
    defaults = TrainConfig()
    hints = typing.get_type_hints(TrainConfig)
    lines = [
        USAGE,
        "",
        __doc__.split("\n\n")[0],
        "",
        "A CONFIG_FILE is a Python file whose top-level assignments set keys; --key=value sets one key",
        "(applied in order). Ints, floats, bools (True/False), strings, and tuples of ints (64,128).",
        "train_config.py says what each key does.",
        "",
        "keys (--key=default  type):",
    ]
    for f in dataclasses.fields(TrainConfig):
        tp = hints[f.name]
        kind = "ints" if typing.get_origin(tp) in (tuple, list) else getattr(tp, "__name__", str(tp))
        lines.append(f"{f'  --{f.name}={_shown(getattr(defaults, f.name))}':<42} {kind}")
    return "\n".join(lines)


def parse_config(argv: Sequence[str]) -> TrainConfig:
    """The config the arguments give, checked; a ``configurator.ConfigError`` names the bad key or
    argument. ``-h``/``--help`` prints :func:`usage` and exits with status 0."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage())
        raise SystemExit(0)
    for arg in argv:
        if arg.startswith("-") and not arg.startswith("--"):
            raise configurator.ConfigError(
                f"unknown option {arg!r}: keys are set as --key=value (--help lists them)"
            )
    cfg = configurator.load_config(TrainConfig, argv, base_dir=HERE)
    try:
        cfg.validate()
    except ValueError as e:
        raise configurator.ConfigError(str(e)) from None
    return cfg


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train as the arguments say; returns a summary (losses, evaluations, backend, paths)."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv)
    out_dir = (HERE / cfg.out_dir).resolve()
    data_root = (HERE / cfg.data_dir).resolve()
    ckpt_path = out_dir / "ckpt.pt"

    # Resuming keeps the checkpoint's model shape; its block_size is also the length trained at.
    checkpoint, config_block_size = None, cfg.block_size
    if cfg.init_from == "resume":
        if not ckpt_path.exists():
            raise FileNotFoundError(f"init_from='resume' but there is no checkpoint at {ckpt_path}")
        # On the CPU: the model is built there and moved after loading; the optimizer moves its state.
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if checkpoint["model_args"]["block_size"] != cfg.block_size:
            cfg = dataclasses.replace(cfg, block_size=checkpoint["model_args"]["block_size"])
            cfg.validate()

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
        # Sequence parallelism: a ("dp", "cp") mesh, context_parallel processes per sequence.
        cp = context_parallel.make_mesh(device, world, cfg) if cfg.context_parallel > 1 else None
        replicas = world // cfg.context_parallel
        # gradient_accumulation_steps counts micro-batches per iteration over all replicas
        # (nanoGPT's convention); fewer than the replicas means one per replica.
        if cfg.gradient_accumulation_steps > replicas and cfg.gradient_accumulation_steps % replicas != 0:
            raise ValueError(
                f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must be a multiple "
                f"of the number of data-parallel replicas ({replicas}), or at most {replicas}"
            )
        grad_accum = max(1, cfg.gradient_accumulation_steps // replicas)
    else:
        context_parallel.check_launched(cfg)
        rank, world, replicas, grad_accum, cp = 0, 1, 1, cfg.gradient_accumulation_steps, None
        device = resolve_device(cfg.device)
    master = rank == 0
    if not master:

        def log(*_):
            return None

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    tokens_per_iter = grad_accum * replicas * cfg.batch_size * cfg.block_size
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
    # With context parallelism every rank draws the global batch (replicas x batch_size rows, as one
    # process with that batch size would) and keeps its rows and its chunk of positions.
    batches = Batches(context_parallel.data_config(cfg, replicas, cp), data_root / cfg.dataset, device)
    data_gen = torch.Generator().manual_seed(cfg.seed + (0 if cp else rank))

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
    iter_num, best_val_loss = 0, 1e9
    checkpoint_peak: tuple[float, str] | None = None
    resumed_len = 0  # the recall curriculum's training length in the checkpoint
    if checkpoint is not None:
        check_same_attention(model_args, checkpoint["model_args"])
        model_args["block_size"] = config_block_size  # what the config said, for the note
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "bias", "vocab_size"):
            if model_args[k] != checkpoint["model_args"][k] and not (k == "n_kv_head" and model_args[k] == 0):
                log(
                    f"resume: {k} = {checkpoint['model_args'][k]} from the checkpoint (config said {model_args[k]})"
                )
            model_args[k] = checkpoint["model_args"][k]
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        resumed_len = int(checkpoint.get("recall_seq_len", 0))
        if "peak_flops" in checkpoint:  # the MFU keeps the peak the run started with
            checkpoint_peak = (float(checkpoint["peak_flops"]), str(checkpoint["peak_flops_source"]))
    gptconf = GPTConfig(**model_args)
    with torch.random.fork_rng():  # the same initial weights on every rank (FSDP2 does not broadcast)
        torch.manual_seed(cfg.seed)
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
        else:  # several processes: fresh streams per rank (per replica) and position
            data_gen.manual_seed(cfg.seed + (0 if cp else rank) + 100003 * iter_num)
        checkpoint = None  # free memory
    raw_model = model
    if cfg.compile:
        log("compiling the model (torch.compile)...")
        model = torch.compile(model)
    if cp is not None:
        context_parallel.enable(raw_model, cp)
        model = context_parallel.wrap(model, cp, cfg.parallel, device)
        if cfg.parallel == "fsdp2":  # fully_shard replaced the parameters by sharded ones
            optimizer = raw_model.configure_optimizers(
                cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type
            )
    elif ddp:
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
        f"device {device} x{world}{context_parallel.describe(cp, cfg)} | dtype {str(ptdtype).replace('torch.', '')} | {tokens_per_iter:,} tokens/iter | "
        f"MFU peak {peak / 1e12:.3f} TFLOP/s per device ({peak_note})"
    )

    if master:
        log_reachable(cfg, gptconf, log)

    def save_checkpoint() -> None:
        state = {
            "model": context_parallel.full_state(raw_model.state_dict()),
            "optimizer": context_parallel.full_state(optimizer.state_dict()),
            "model_args": gptconf.to_dict(),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
            "rng": {"torch": torch.get_rng_state(), "data": data_gen.get_state()},
            "peak_flops": peak,
            "peak_flops_source": peak_src,
        }
        if not master:  # with context parallelism every rank gathers the full state; one writes
            return
        if curriculum is not None:
            state["recall_seq_len"] = curriculum.seq_len
        if device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(device)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "ckpt.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)
        log(f"saved checkpoint to {ckpt_path}")

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
        if (iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters or out_of_time) and (
            master or cp is not None
        ):
            losses = estimate_loss(model, batches, cfg, ctx, cp)
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
            if isinstance(model, DDP):  # synchronise gradients only at the last micro step
                model.require_backward_grad_sync = micro == grad_accum - 1
            x, y, doc_starts = batches.get(
                "train", data_gen, None if curriculum is None else curriculum.shape()
            )
            if cp is not None:  # this replica's rows, this rank's positions
                x, y = context_parallel.select(x, cp), context_parallel.select(y, cp)
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
            seq_ranks = world // replicas  # the ranks that share one sequence
            window_flops += (
                raw_model.flops_per_sequence(step_len * seq_ranks) * step_batch * grad_accum * replicas
            )
        train_seconds += dt
        if cp is not None and iter_num % cfg.log_interval == 0:  # the mean over every rank's tokens
            dist.all_reduce(loss_sum)
            loss_sum /= world
        if iter_num % cfg.log_interval == 0 and master:
            lossf = loss_sum.item()
            summary["losses"].append((iter_num, lossf))
            timing = "-- ms/iter | -- tok/s | mfu --"
            if window_iters:  # averages over the iterations since the last progress line
                per_iter = window_time / window_iters
                tok_s = tokens_per_iter / per_iter
                mfu = window_flops / (window_time * peak * world)
                if mfu > 1 and "measured" in peak_src:  # the peak was measured while the machine was busy
                    peak = max(peak, measure_peak(device, ptdtype))
                    log(f"MFU peak measured again: {peak / 1e12:.3f} TFLOP/s per device")
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
    except configurator.ConfigError as e:  # a bad argument or key: a usage error, as argparse's
        print(f"{USAGE}\ntrain.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
