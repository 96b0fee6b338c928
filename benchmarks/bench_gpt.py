"""Training speed of the example GPT (``examples/gpt``) with each attention backend, side by side.

Every configuration (block size x attention backend x ``torch.compile`` off/on) trains a fresh
model, built with the same seed, on synthetic random tokens: ``--warmup`` steps, then ``--steps``
timed steps (forward, backward, gradient clipping, AdamW), with the example's own model,
optimizer (``GPT.configure_optimizers``), mixed precision (autocast, as ``train.py`` runs it) and
FLOP count (``GPT.flops_per_sequence``). Reported per configuration: tokens/s, ms per step, MFU
(the model's FLOPs over the device's peak, ``train_utils.peak_flops``: a table of GPUs for bf16 and
fp16, else a matmul measured at the start), the ratio of tokens/s to dense attention's at the same
block size and compile setting (measured in the same run), the peak memory of the allocator on a
GPU and, compiled, the graph breaks Dynamo reported. The default is GPT-2 small (12 layers, 12
heads, 768 dims, vocab 50304, batch 1) in bf16 on CUDA at blocks 16K and 64K, with LongNet's
branches w = 2048 * 2^i up to the block and r = 2^i (16K: w = [2048, 4096, 8192, 16384],
r = [1, 2, 4, 8]); dense attention is causal ``scaled_dot_product_attention`` over the whole block.

A configuration that fails (out of memory, a backend that cannot run) is a row that says why, and
the others go on. A backend that the backend layer replaces by another (with a warning) is
measured as what ran, in the "runs as" column. The table is printed and written, after every
configuration, as ``<out>/gpt-<device>.md`` and ``.csv`` with the device's name, the torch
version, the date and the commit (``unknown`` outside a git checkout of its own); a run that
finds results of that name writes beside them, with the time in the name.

    python benchmarks/bench_gpt.py                             # GPT-2 small, 16K and 64K, on a GPU
    python benchmarks/bench_gpt.py --blocks 16k --compile off --steps 10
    python benchmarks/bench_gpt.py --dry-run                   # every line, tiny, on the CPU
    python benchmarks/bench_gpt.py --profile native:16k:eager  # one profiled step, a text file

``--dry-run`` runs every configuration at tiny sizes on the CPU (2 layers, 2 heads, 64 dims, vocab
256, block 256 with w = [64, 128, 256], r = [1, 2, 4], float32, 1 + 2 steps, compiled with
``aot_eager`` rather than inductor) and writes to a temporary folder (or ``--out``).
``--profile BACKEND:BLOCK[:eager|compile]`` instead runs ``torch.profiler`` over one training step
of that configuration (after the warm-up steps) and writes the top operations by self device
time (CUDA) or self CPU time, with the number of ATen calls and of kernel launches, to
``<out>/gpt-profile-<device>-<backend>-<block>-<mode>.txt``: the host's share of a step.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this file (it adds the checkout)
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))  # the example
import benchlib as lib
from model import ATTENTION_BACKENDS, GPT, GPTConfig
from train_config import DTYPES, TrainConfig
from train_utils import auto_dtype, backend_in_use, peak_flops

ROOT = lib.ROOT
RESULTS = lib.RESULTS
BACKENDS = ["dense", "auto", "native", "sdpa"]
COMPILE = {"off": [False], "on": [True], "both": [False, True]}
# The optimizer of GPT-2 small's training (nanoGPT): AdamW, lr 6e-4, betas (0.9, 0.95), clipping at 1.
LEARNING_RATE, BETAS, WEIGHT_DECAY, GRAD_CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0
DRY_RUN = {
    "layers": 2,
    "heads": 2,
    "embd": 64,
    "vocab": 256,
    "blocks": [256],
    "w0": 64,
    "warmup": 1,
    "steps": 2,
    "dtype": "float32",
    "device": "cpu",
}
DRY_RUN_COMPILE_BACKEND = "aot_eager"  # AOTAutograd's graphs without inductor's code generation: seconds
META_FIELDS = ["device", "torch", "cuda", "commit", "date", "dtype"]  # repeated on every CSV row
CSV_FIELDS = [
    *META_FIELDS,
    "block",
    "backend",
    "runs_as",
    "compiled",
    "segments",
    "rates",
    "tokens_per_s",
    "ms_per_step",
    "mfu",
    "vs_dense",
    "peak_gib",
    "graph_breaks",
    "loss",
    "status",
]


@dataclass
class Row:
    """One configuration's result; ``status`` is ``ok`` or why it failed."""

    block: int
    backend: str
    compiled: bool
    segments: str
    rates: str
    runs_as: str = ""
    tokens_per_s: float = float("nan")
    ms_per_step: float = float("nan")
    mfu: float = float("nan")
    vs_dense: float = float("nan")
    peak_gib: float = float("nan")
    graph_breaks: int | None = None
    loss: float = float("nan")
    status: str = "ok"


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


# Variants of a backend run under an environment of their own (a row each, named as here).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    # native with the tensor-core passes on Hopper's warpgroup MMA (csrc/cuda/tc90_kernels.cuh)
    "native-sm90": ("native", {"DILATED_ATTENTION_CUDA_SM90": "1"}),
}
backend_list = lib.names_among([*ATTENTION_BACKENDS, *VARIANTS])


@contextmanager
def variant_env(name: str) -> Iterator[str]:
    """The backend that row ``name`` trains with, under the variant's environment, if any."""
    backend, env = VARIANTS.get(name, (name, {}))
    with patch.dict(os.environ, env):  # restored after the row, also when it fails
        yield backend


def profile_spec(text: str) -> tuple[str, int, bool]:
    """``BACKEND:BLOCK[:eager|compile]`` (``native:16k``, ``sdpa:64k:compile``)."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 3 or parts[0] not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"expected BACKEND:BLOCK[:eager|compile] with BACKEND among {','.join(ATTENTION_BACKENDS)}, "
            f"got {text!r}"
        )
    mode = parts[2] if len(parts) == 3 else "eager"
    if mode not in ("eager", "compile"):
        raise argparse.ArgumentTypeError(f"the mode must be eager or compile, got {text!r}")
    try:
        block = lib.positive_int(parts[1])
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"BLOCK must be an integer >= 1, got {text!r}") from None
    return parts[0], block, mode == "compile"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=lib.positive_int_list, default=[16 * 1024, 64 * 1024])
    p.add_argument(
        "--backends",
        type=backend_list,
        default=BACKENDS,
        help="comma-separated (default: dense,auto,native,sdpa; native-sm90: native with "
        "DILATED_ATTENTION_CUDA_SM90=1)",
    )
    p.add_argument("--compile", choices=sorted(COMPILE), default="both", help="torch.compile off, on or both")
    p.add_argument(
        "--compile-backend",
        default=None,
        help=f"torch.compile's backend (default: inductor; {DRY_RUN_COMPILE_BACKEND} with --dry-run)",
    )
    p.add_argument(
        "--warmup", type=lib.nonnegative_int, default=5, help="untimed steps (compilation, allocation)"
    )
    p.add_argument("--steps", type=lib.positive_int, default=20, help="timed steps")
    p.add_argument("--layers", type=lib.positive_int, default=12)
    p.add_argument("--heads", type=lib.positive_int, default=12)
    p.add_argument("--embd", type=lib.positive_int, default=768, help="model width (heads x head dim)")
    p.add_argument("--vocab", type=lib.positive_int, default=50304)
    p.add_argument("--batch", type=lib.positive_int, default=1)
    p.add_argument(
        "--w0", type=lib.positive_int, default=2048, help="first segment length (w0 * 2^i, r = 2^i)"
    )
    p.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on GPUs from sm80"
    )
    p.add_argument(
        "--device", type=lib.device, default=None, help="default: cuda where there is one, else cpu"
    )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--budget",
        type=lib.nonnegative_float,
        default=0.0,
        help="seconds: no configuration starts after this much time (a row says so); 0: no limit",
    )
    p.add_argument(
        "--peak-flops",
        type=lib.nonnegative_float,
        default=0.0,
        help="per device, for the MFU (0: table or measured)",
    )
    p.add_argument(
        "--out", default=None, help=f"folder of the results (default: {RESULTS.relative_to(ROOT)})"
    )
    p.add_argument("--tag", default=None, help="file stem of the results (default: gpt-<device>)")
    p.add_argument("--dry-run", action="store_true", help="every configuration, tiny, on the CPU (see above)")
    p.add_argument(
        "--profile",
        type=profile_spec,
        default=None,
        metavar="BACKEND:BLOCK[:eager|compile]",
        help="profile one training step of this configuration instead of the table",
    )
    p.add_argument(
        "--profile-rows", type=lib.positive_int, default=30, help="operations in the profile's table"
    )
    args = p.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
        args.compile_backend = args.compile_backend or DRY_RUN_COMPILE_BACKEND
        if args.profile is not None:  # the profiled configuration at the dry run's block
            args.profile = (args.profile[0], DRY_RUN["blocks"][0], args.profile[2])
    if args.embd % args.heads:
        p.error(f"--embd {args.embd} must be a multiple of --heads {args.heads}")
    if args.embd // args.heads > lib.MAX_HEAD_DIM:
        p.error(
            f"--embd {args.embd} / --heads {args.heads} = {args.embd // args.heads}: the head dim must be "
            f"at most {lib.MAX_HEAD_DIM} (dilated_attention's head dims)"
        )
    args.compile_backend = args.compile_backend or "inductor"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# ----------------------------------------------------------------------------------------------
# One configuration
# ----------------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace, block: int, backend: str) -> GPTConfig:
    segs, rates = lib.longnet_branches(block, args.w0)
    return GPTConfig(
        block_size=block,
        vocab_size=args.vocab,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
        attention_backend=backend,
        segment_lengths=segs,
        dilation_rates=rates,
    )


def runs_as(conf: GPTConfig, device: torch.device, dtype: torch.dtype) -> str:
    """What computes the attention (``train_utils.backend_in_use``, as train.py logs it)."""
    cfg = TrainConfig(
        block_size=conf.block_size,
        n_layer=conf.n_layer,
        n_head=conf.n_head,
        n_embd=conf.n_embd,
        attention_backend=conf.attention_backend,
        dropout=conf.dropout,
    )
    return backend_in_use(cfg, device, dtype)


def build(
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    conf: GPTConfig,
    compiled: bool,
) -> tuple[GPT, Callable[[int], torch.Tensor], int]:
    """A fresh model (seeded) and its training step ``step(i) -> loss``, on the i-th batch of
    random tokens (as many batches as steps are asked for), and the number of batches."""
    torch.manual_seed(args.seed)
    model = GPT(conf).to(device)
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS, device.type)
    forward = torch.compile(model, backend=args.compile_backend) if compiled else model
    ctx: AbstractContextManager[Any] = (
        nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device.type, dtype=dtype)
    )
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    n = max(args.warmup + args.steps, 1)
    gen = torch.Generator().manual_seed(args.seed)
    shape = (n, args.batch, conf.block_size)
    xs = torch.randint(conf.vocab_size, shape, generator=gen).to(device)
    ys = torch.randint(conf.vocab_size, shape, generator=gen).to(device)

    def step(i: int) -> torch.Tensor:
        with ctx:
            _, loss = forward(xs[i % n], ys[i % n])
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step, n


def fresh(device: torch.device) -> None:
    """Nothing of the previous configuration left: Dynamo's caches and counters, memory."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, row: Row, peak: float
) -> None:
    """Trains ``row``'s configuration and fills in its numbers."""
    with variant_env(row.backend) as backend:
        conf = model_config(args, row.block, backend)
        row.runs_as = runs_as(conf, device, dtype)
        model, step, _ = build(args, device, dtype, conf, row.compiled)
        for i in range(args.warmup):
            step(i)
        lib.sync(device)
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            loss = step(i)
        lib.sync(device)
        seconds = time.perf_counter() - t0
    row.loss = float(loss)
    row.tokens_per_s = args.batch * row.block * args.steps / seconds
    row.ms_per_step = 1e3 * seconds / args.steps
    row.mfu = model.flops_per_sequence(row.block) * args.batch * args.steps / (seconds * peak)
    if device.type == "cuda":
        row.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    if row.compiled:
        row.graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())


def failure(exc: BaseException) -> str:
    """Why a configuration failed, in one line."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "failed: out of memory"
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    text = f"failed: {type(exc).__name__}" + (f": {lines[0]}" if lines else "")
    return text if len(text) <= 200 else text[:197] + "..."


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def fill_ratios(rows: list[Row]) -> None:
    """tok/s over dense attention's tok/s at the same block size and compile setting."""
    dense = {(r.block, r.compiled): r.tokens_per_s for r in rows if r.backend == "dense" and r.status == "ok"}
    for r in rows:
        base = dense.get((r.block, r.compiled))
        r.vs_dense = r.tokens_per_s / base if base and r.status == "ok" else float("nan")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or value != value else format(value, fmt)


def table(rows: list[Row]) -> list[str]:
    """The markdown table of the rows."""
    lines = [
        "| block | backend | runs as | compile | tok/s | ms/step | MFU | vs dense | peak GiB | graph breaks | status |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.block} | {r.backend} | {r.runs_as or '-'} | {'on' if r.compiled else 'off'} | "
            f"{_num(r.tokens_per_s, ',.0f')} | {_num(r.ms_per_step, '.1f')} | {_num(100 * r.mfu, '.1f')}% | "
            f"{_num(r.vs_dense, '.2f')} | {_num(r.peak_gib, '.1f')} | "
            f"{'-' if r.graph_breaks is None else r.graph_breaks} | {r.status.replace('|', '/')} |"
        )
    return lines


def header(args: argparse.Namespace, meta: dict[str, str]) -> list[str]:
    return [
        "# Training speed of the example GPT by attention backend",
        "",
        f"- device: {meta['device']}",
        f"- torch {meta['torch']}, CUDA {meta['cuda']}; commit {meta['commit']}; {meta['date']}",
        f"- model: {args.layers} layers, {args.heads} heads, {args.embd} dims, vocab {args.vocab}, "
        f"batch {args.batch}, {meta['dtype']}; branches w = {args.w0} * 2^i up to the block, r = 2^i",
        f"- {args.warmup} warm-up + {args.steps} timed steps per configuration (AdamW, clipping), "
        f"each in a fresh model with seed {args.seed}, random tokens; compiled with "
        f"torch.compile(backend={args.compile_backend!r})",
        f"- MFU peak {meta['peak']} ({meta['peak_source']}); vs dense = tok/s over dense attention's "
        "tok/s at the same block and compile setting, measured in this run",
        f"- command: `{meta['command']}`",
        "",
    ]


def write(stem: Path, args: argparse.Namespace, meta: dict[str, str], rows: list[Row]) -> None:
    """``stem``.md (header and table) and ``stem``.csv."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join([*header(args, meta), *table(rows), ""]))
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows({**{k: meta[k] for k in META_FIELDS}, **asdict(r)} for r in rows)


def results_stem(args: argparse.Namespace, out: Path, kind: str, device: torch.device) -> Path:
    """``out/<tag>`` or ``out/gpt-<kind><device>``, with the time added when that exists already."""
    stem = out / (args.tag or f"gpt-{kind}{lib.slug(lib.device_name(device))}")
    return Path(lib.fresh_stem(stem, (".md", ".csv", ".txt"), overwrite=args.tag is not None))


# ----------------------------------------------------------------------------------------------
# The profile of one step
# ----------------------------------------------------------------------------------------------


def profile_step(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, stem: Path, meta: dict[str, str]
) -> Path:
    """One training step of ``args.profile``'s configuration under ``torch.profiler`` (after the
    warm-up steps): the top operations and the numbers of ATen calls and kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    backend, block, compiled = args.profile
    conf = model_config(args, block, backend)
    _, step, _ = build(args, device, dtype, conf, compiled)
    for i in range(max(args.warmup, 1)):
        step(i)
    lib.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step(max(args.warmup, 1))
        lib.sync(device)
        seconds = time.perf_counter() - t0
    events = prof.key_averages()
    on_gpu = device.type == "cuda"
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"  # "cuda": any torch version
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or "GraphLaunch" in e.key)
    kernels = sum(
        e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    )
    cpu_us = sum(e.self_cpu_time_total for e in events)
    device_us = on_gpu and sum(
        getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) for e in events
    )
    lines = [
        f"one training step of the example GPT under torch.profiler: backend {backend}, block {block}, "
        f"{'compiled' if compiled else 'eager'}",
        f"device {meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, commit {meta['commit']}, "
        f"{meta['date']}",
        f"model {args.layers} layers, {args.heads} heads, {args.embd} dims, vocab {args.vocab}, batch "
        f"{args.batch}, {meta['dtype']}; segments {list(conf.segment_lengths)} rates {list(conf.dilation_rates)}",
        f"attention runs as: {runs_as(conf, device, dtype)}",
        "",
        f"step wall time (profiled): {seconds * 1e3:.1f} ms",
        f"ATen calls (aten::*, nested ones included): {aten}",
        f"kernel launches (host launch calls): {launches}; kernels run on the device: {kernels}",
        f"self CPU time, all events: {cpu_us / 1e3:.1f} ms"
        + (f"; self device time: {device_us / 1e3:.1f} ms" if on_gpu else ""),
        "",
        f"top {args.profile_rows} by {sort}:",
        events.table(sort_by=sort, row_limit=args.profile_rows),
    ]
    path = stem.with_suffix(".txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:10]))
    return path


# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = auto_dtype(device) if args.dtype == "auto" else DTYPES[args.dtype]
    if device.type == "cuda":  # as train.py sets them
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = (
        Path(args.out)
        if args.out
        else (Path(tempfile.mkdtemp(prefix="bench_gpt-")) if args.dry_run else RESULTS)
    )
    meta = {
        "device": f"{lib.device_name(device)} ({device})",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda) if device.type == "cuda" else "none",
        "commit": lib.git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype).replace("torch.", ""),
        "command": shlex.join(
            ["python", "benchmarks/bench_gpt.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    if args.profile is not None:
        backend, block, compiled = args.profile
        kind = f"profile-{backend}-{block}-{'compile' if compiled else 'eager'}-"
        path = profile_step(args, device, dtype, results_stem(args, out, kind, device), meta)
        print(f"wrote {path}")
        return 0
    peak, source = peak_flops(device, dtype, args.peak_flops)
    meta.update(peak=f"{peak / 1e12:.3f} TFLOP/s", peak_source=source)
    stem = results_stem(args, out, "", device)
    rows: list[Row] = []
    configs = [
        (block, compiled, backend)
        for block in args.blocks
        for compiled in COMPILE[args.compile]
        for backend in args.backends
    ]
    start = time.perf_counter()
    with tqdm(configs, unit="config", dynamic_ncols=True) as bar:
        for block, compiled, backend in bar:
            bar.set_description(f"{backend} {block} {'compiled' if compiled else 'eager'}")
            segs, rates = lib.longnet_branches(block, args.w0)
            row = Row(block, backend, compiled, ",".join(map(str, segs)), ",".join(map(str, rates)))
            spent = time.perf_counter() - start
            if args.budget and spent >= args.budget:  # what is left is a row each, not a silence
                row.status = f"not run: the budget of {args.budget:g} s was spent ({spent:.0f} s)"
            else:
                fresh(device)
                try:
                    measure(args, device, dtype, row, peak)
                except Exception as exc:  # a failed configuration is a row saying why; the rest go on
                    row.status = failure(exc)
            rows.append(row)
            fresh(device)
            fill_ratios(rows)
            write(stem, args, meta, rows)
    print("\n".join([*header(args, meta), *table(rows)]))
    print(f"wrote {stem.with_suffix('.md')}, {stem.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
