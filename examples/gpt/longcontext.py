"""What long context buys: train the recall task with three attentions and compare them.

Runs ``train.py`` on a config of the recall task (``config/recall.py`` by default) once per
attention, each in its own process and within the same wall-time budget (``max_minutes``):

* ``dilated``: LongNet-style branches whose longest segment spans the whole block,
  ``(row, T/32, T) x (1, 2, 4)`` (``(8, 64, 2048)`` for the default);
* ``local``: the same branches with the long one cut to a quarter of the block at the same
  cost, ``(row, T/32, T/4) x (1, 2, 2)``: a local window (the segment lengths divide each other,
  so no number of layers reads past the segment of the last ``T/4`` tokens);
* ``dense``: plain causal attention.

It writes, to ``--results`` (default ``out-longcontext/``): ``curves.csv`` (every evaluation:
steps, training seconds, loss, answer accuracy), ``summary.csv`` and ``summary.md`` (per
attention: query-key pairs, the reachable fraction, steps, final accuracy, tokens/s, peak
memory) and ``longcontext.png`` (answer accuracy against steps and against training time)::

    python longcontext.py                                       # config/recall.py, 3 x 10 minutes
    python longcontext.py config/recall.py --max_minutes=2 --variants=dilated,local
    python longcontext.py --block_size=8192 --results=out-longcontext-8k

Other ``--key=value`` arguments go to every ``train.py`` run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import resource
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import configurator  # noqa: E402 (the script's folder is put on sys.path first)
import recall  # noqa: E402
import train  # noqa: E402
from model import attention_pairs  # noqa: E402

VARIANTS = ("dilated", "local", "dense")


def variant_args(name: str, block_size: int, row: int) -> list[str]:
    """The ``train.py`` arguments that choose the attention of a variant at ``block_size``."""
    if name == "dense":
        return ["--attention_backend=dense"]
    mid = max(block_size // 32, row)
    if name == "dilated":
        segs, rates = [row, mid, block_size], [1, 2, 4]
    elif name == "local":
        # pairs per query: w / (2 r^2) for each branch, so (T/4, 2) costs what (T, 4) does
        segs, rates = [row, mid, block_size // 4], [1, 2, 2]
    else:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {name!r}")
    return [f"--segment_lengths={segs}".replace(" ", ""), f"--dilation_rates={rates}".replace(" ", "")]


def _flag(s: str) -> bool:
    if s.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
    return s.lower() in ("1", "true", "yes")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _run_variant(argv: list[str], log_path: str, result_path: str) -> None:
    """In a fresh process: train, and write the summary with the process's peak memory."""
    start_rss = _peak_rss_mib()
    with open(log_path, "w") as log_file:

        def log(msg: str) -> None:
            print(msg, file=log_file, flush=True)
            print(f"[{Path(log_path).stem}] {msg}", flush=True)

        out = train.main(argv, log=log)
    cfg = out["config"]
    device = train.resolve_device(cfg.device)
    result = {
        "evals": out["evals"],
        "iter_num": out["iter_num"],
        "train_seconds": out["train_seconds"],
        "backend": out["backend"],
        "tokens": out["tokens"],
        "peak_rss_mib": _peak_rss_mib(),
        "start_rss_mib": start_rss,
        "peak_cuda_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "segment_lengths": list(cfg.segment_lengths),
        "dilation_rates": list(cfg.dilation_rates),
    }
    Path(result_path).write_text(json.dumps(result))


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Train every variant, write the curves, the table and the plot; returns the results."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + str(VARIANTS))
    parser.add_argument(
        "--results", default="out-longcontext", help="output folder (relative to this script)"
    )
    parser.add_argument("--plot", type=_flag, default=True, help="write longcontext.png (matplotlib)")
    parser.add_argument(
        "--throughput_rounds",
        type=int,
        default=5,
        help="after training, time this many steps of each variant side by side (0: none)",
    )
    parser.add_argument(
        "--merge",
        type=_flag,
        default=False,
        help="also tabulate the variants not run now from their results in --results (a rerun of one)",
    )
    parser.add_argument(
        "--isolate", type=_flag, default=True, help="one process per variant (its own peak memory)"
    )
    args, train_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not train_argv or train_argv[0].startswith("--"):
        train_argv = [str(HERE / "config" / "recall.py"), *train_argv]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise ValueError(f"--variants: {v!r} is not one of {list(VARIANTS)}")
    cfg = configurator.load_config(train.TrainConfig, train_argv, base_dir=HERE)
    if cfg.dataset != "recall":
        raise ValueError(f"longcontext.py trains the recall task; the config says dataset={cfg.dataset!r}")
    cfg.validate()
    results_dir = (HERE / args.results).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, Any]] = {}
    ctx = multiprocessing.get_context("spawn")
    for name in names:
        run_argv = [
            *train_argv,
            *variant_args(name, cfg.block_size, cfg.recall_row),
            f"--out_dir={results_dir / name}",
        ]
        result_path = results_dir / f"{name}.json"
        result_path.unlink(missing_ok=True)
        job = (run_argv, str(results_dir / f"{name}.log"), str(result_path))
        if args.isolate:
            proc = ctx.Process(target=_run_variant, args=job)
            proc.start()
            proc.join()
            if proc.exitcode != 0 or not result_path.exists():
                raise RuntimeError(
                    f"variant {name!r} failed (exit code {proc.exitcode}); see {results_dir / name}.log"
                )
        else:
            _run_variant(*job)
        results[name] = json.loads(result_path.read_text())

    if args.merge:
        for name in VARIANTS:
            path = results_dir / f"{name}.json"
            if name not in results and path.exists():
                results[name] = json.loads(path.read_text())
        results = {name: results[name] for name in VARIANTS if name in results}
    if args.throughput_rounds > 0:
        for name, tok_s in measure_throughput(cfg, results, args.throughput_rounds).items():
            results[name]["side_by_side_tokens_per_second"] = tok_s
    rows = summarize(results, cfg)
    write_tables(results, rows, results_dir)
    if args.plot:
        plot(results, cfg, results_dir / "longcontext.png")
    print((results_dir / "summary.md").read_text())
    return {"results": results, "summary": rows, "dir": str(results_dir)}


def measure_throughput(
    cfg: train.TrainConfig, results: dict[str, dict[str, Any]], rounds: int = 5
) -> dict[str, float]:
    """Training tokens/s of each variant at full length, measured side by side: in every round one
    forward, backward and optimizer step of each, in turn; the median over the rounds. On a busy
    machine this compares the attentions under the same load, which runs minutes apart do not."""
    import time

    from model import GPT, GPTConfig

    torch.manual_seed(cfg.seed)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    x, y, _, _ = recall.recall_batch(
        cfg.batch_size, cfg.block_size, cfg.recall_pairs, cfg.recall_queries, cfg.recall_row
    )
    models = {}
    for name, r in results.items():
        gpt = GPT(
            GPTConfig(
                block_size=cfg.block_size,
                vocab_size=recall.VOCAB_SIZE,
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                n_embd=cfg.n_embd,
                bias=cfg.bias,
                attention_backend="dense" if name == "dense" else cfg.attention_backend,
                segment_lengths=r["segment_lengths"],
                dilation_rates=r["dilation_rates"],
            )
        )
        models[name] = (gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-4))
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(rounds + 1):
        for name, (gpt, opt) in models.items():
            t0 = time.perf_counter()
            _, loss = gpt(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i > 0:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return {name: x.numel() / sorted(t)[len(t) // 2] for name, t in times.items()}


def summarize(results: dict[str, dict[str, Any]], cfg: train.TrainConfig) -> list[dict[str, Any]]:
    """One row per variant: attention, cost, ceiling, and what training reached."""
    T, H = cfg.block_size, cfg.n_head
    dense_pairs = attention_pairs(T, H, [T], [1])
    rows = []
    for name, r in results.items():
        dense = name == "dense"
        pairs = attention_pairs(T, H, r["segment_lengths"], r["dilation_rates"], dense=dense)
        reach = (
            recall.reachable_fraction(
                T,
                cfg.n_layer,
                H,
                r["segment_lengths"],
                r["dilation_rates"],
                dense=dense,
                n_pairs=cfg.recall_pairs,
                n_queries=cfg.recall_queries,
                row=cfg.recall_row,
            )
            if T <= 8192
            else float("nan")
        )
        last = r["evals"][-1]
        best = max(e["val_answer_acc"] for e in r["evals"])
        to90 = next((e for e in r["evals"] if e["val_answer_acc"] >= 0.9), None)
        full = next((e for e in r["evals"] if e.get("seq_len", T) >= T), None)
        branches = (
            "dense causal"
            if dense
            else " ".join(
                f"({w},{k})" for w, k in zip(r["segment_lengths"], r["dilation_rates"], strict=True)
            )
        )
        rows.append(
            {
                "attention": name,
                "branches": branches,
                "backend": r["backend"],
                "pairs_per_token_per_head": pairs / (T * H),
                "pairs_vs_dense": pairs / dense_pairs,
                "reachable": reach,
                "steps": r["iter_num"],
                "train_len_reached": last.get("seq_len", T),
                "steps_to_full_len": full["iter"] if full else None,
                "train_seconds": r["train_seconds"],
                "final_val_answer_acc": last["val_answer_acc"],
                "best_val_answer_acc": best,
                "steps_to_90": to90["iter"] if to90 else None,
                "seconds_to_90": to90["seconds"] if to90 else None,
                "tokens_per_second": r["tokens"] / max(r["train_seconds"], 1e-9),
                "side_by_side_tokens_per_second": r.get("side_by_side_tokens_per_second"),
                "peak_rss_mib": r["peak_rss_mib"],
                "start_rss_mib": r["start_rss_mib"],
                "peak_cuda_mib": r["peak_cuda_mib"],
            }
        )
    return rows


def write_tables(results: dict[str, dict[str, Any]], rows: list[dict[str, Any]], results_dir: Path) -> None:
    with open(results_dir / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["attention", "step", "train_seconds", "val_loss", "train_answer_acc", "val_answer_acc"])
        for name, r in results.items():
            for e in r["evals"]:
                w.writerow(
                    [
                        name,
                        e["iter"],
                        f"{e['seconds']:.1f}",
                        f"{e['val']:.4f}",
                        f"{e['train_answer_acc']:.4f}",
                        f"{e['val_answer_acc']:.4f}",
                    ]
                )
    with open(results_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    json.dump(rows, open(results_dir / "summary.json", "w"), indent=1)

    def fmt_time(s: float | None) -> str:
        return "–" if s is None else f"{s / 60:.1f} min"

    gpu = any(r["peak_cuda_mib"] is not None for r in rows)
    lines = [
        "| attention | branches (segment, rate) | pairs per query (% of dense) | reachable | steps | "
        "training length reached | answer accuracy (best) | to 90% | tokens/s in training | "
        "tokens/s side by side | peak memory (over the start) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mem = (
            f"{r['peak_cuda_mib']:.0f} MiB GPU"
            if gpu
            else f"{r['peak_rss_mib']:.0f} MiB RSS (+{r['peak_rss_mib'] - r['start_rss_mib']:.0f})"
        )
        side = r["side_by_side_tokens_per_second"]
        side = "–" if side is None else f"{side:,.0f}"
        to90 = (
            "–" if r["steps_to_90"] is None else f"{r['steps_to_90']} steps, {fmt_time(r['seconds_to_90'])}"
        )
        lines.append(
            f"| {r['attention']} | {r['branches']} | {r['pairs_per_token_per_head']:.0f} "
            f"({r['pairs_vs_dense']:.0%}) | {r['reachable']:.0%} | {r['steps']} in {fmt_time(r['train_seconds'])} | "
            f"{r['train_len_reached']:,} | "
            f"{r['final_val_answer_acc']:.1%} ({r['best_val_answer_acc']:.1%}) | {to90} | "
            f"{r['tokens_per_second']:,.0f} | {side} | {mem} |"
        )
    (results_dir / "summary.md").write_text("\n".join(lines) + "\n")


def plot(results: dict[str, dict[str, Any]], cfg: train.TrainConfig, path: Path) -> None:
    """Answer accuracy (validation) against steps and against training time, and the answer loss
    against steps, one line a variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in results.items():
        steps = [e["iter"] for e in r["evals"]]
        minutes = [e["seconds"] / 60 for e in r["evals"]]
        acc = [e["val_answer_acc"] for e in r["evals"]]
        axes[0].plot(steps, acc, marker=".", label=name)
        axes[1].plot(minutes, acc, marker=".", label=name)
        axes[2].plot(steps, [e["val"] for e in r["evals"]], marker=".", label=name)
    for ax, xlabel in zip(axes, ("training steps", "training time (minutes)", "training steps"), strict=True):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.axhline(1 / recall.N_VALUES, color="gray", lw=0.8, ls=":", label="chance")
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("answer accuracy (validation)")
    axes[2].axhline(
        math.log(recall.N_VALUES), color="gray", lw=0.8, ls=":", label=f"chance (ln {recall.N_VALUES})"
    )
    axes[2].set_ylabel("answer loss (validation, nats)")
    axes[1].legend(loc="upper left")
    axes[2].legend(loc="upper right")
    fig.suptitle(
        f"recall over {cfg.block_size:,} tokens: {cfg.recall_pairs} records, {cfg.recall_queries} queries; "
        f"{cfg.n_layer} layers, {cfg.n_embd} dims, {cfg.n_head} heads"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    try:
        run()
    except (configurator.ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None
