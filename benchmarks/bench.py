"""Benchmark of dilated attention: every backend that can run, against what a user would pick instead.

Times the forward and the forward+backward of

* every backend of ``dilated_attention`` that can run the inputs on this device (``native``,
  ``sdpa``, ``manual``, and ``flash_attn_*``/``xformers`` where installed), called through
  ``dilated_attention.dilated_attention(..., backend=name)``;
* three alternatives written here in plain PyTorch, independent of the project's code:
  ``dense_causal_sdpa`` (causal SDPA over the whole sequence: a different, denser attention that a
  user might run instead), ``dense_mask_sdpa`` (SDPA with a dense (H, N, N) additive mask that
  holds log(multiplicity) of every (query, key) pair of the dilated pattern, -inf elsewhere: the
  same function as the project's), and ``gather_sdpa`` (per branch and head phase: gather the
  covered positions, run SDPA's kernel that also returns the log-sum-exp, scatter back, merge the
  branches by their log-sum-exp; its gradient treats the mixing weights as constants because
  PyTorch's log-sum-exp output carries no gradient, which makes its backward cheaper, not dearer).

For each case it reports ms (median of the repeats), tokens/s, useful TFLOP/s (SPEC section 3:
forward = 4 * D * (query, key) pairs of the dilated pattern with multiplicity, backward = 2.5 x
forward; the same numerator for every method, so it compares time to the dilated result) and the
peak memory: on CPU the rise of the process's peak RSS (VmHWM) over its RSS once the inputs exist,
each case in a fresh subprocess; on CUDA ``torch.cuda.max_memory_allocated`` over the inputs.
What would not fit in memory or would take longer than ``--max-seconds`` per call (predicted from
the previous N of the same method) is skipped and recorded with the reason.

It writes ``<out>/<tag>.csv``, ``.json`` (rows plus machine, versions, date) and ``.png``
(time and memory against N, log-log); where results of that name exist already (the committed
ones in ``benchmarks/results/``), it writes ``<tag>-<date>-<time>.*`` beside them instead, unless
``--overwrite`` is given. It prints the target checks of the CPU kernel:
native forward+backward against the fastest alternative, native forward FLOP rate against
``torch.mm`` (2048 x 2048, float32) measured in the same run, peak bytes per token at two N, and
the long-sequence scale run.

    python benchmarks/bench.py                  # the full CPU sweep, N = 1K..256K, plus N = 1M
    python benchmarks/bench.py --quick          # N = 1K..8K, one repeat: a smoke run
    python benchmarks/bench.py --n 8192,16384 --methods native,gather_sdpa
    python benchmarks/bench.py --device cuda    # N = 1K..4M on a GPU
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# benchlib beside this file; importing it puts the checkout's package on the path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as lib

from dilated_attention.flops import attention_flops, attention_pairs, matmul_flops

log = logging.getLogger("bench")

BACKENDS = ("native", "flash_attn_3", "flash_attn_2", "xformers", "sdpa", "manual")
ALTERNATIVES = ("dense_causal_sdpa", "dense_mask_sdpa", "gather_sdpa")
MODES = ("fwd", "fwdbwd")
DTYPES = lib.DTYPES
K = lib.K


# ------------------------------------------------------------------------------------------------
# Work and memory models
# ------------------------------------------------------------------------------------------------


def method_work(method: str, N: int, cfg: dict) -> float:
    """A number proportional to the method's own work at N (for predicting its time)."""
    if method == "dense_causal_sdpa":
        return N * (N + 1) / 2
    if method == "dense_mask_sdpa":
        return float(N) * N
    return float(attention_pairs(N, cfg["H"], cfg["segs"], cfg["rates"], cfg["causal"]) + N)


def memory_model(method: str, N: int, cfg: dict, mode: str) -> float:
    """A rough upper estimate of peak bytes, used only before the method has been measured."""
    elem = torch.finfo(DTYPES[cfg["dtype"]]).bits // 8
    x = cfg["B"] * N * cfg["H"] * cfg["D"] * max(elem, 4)
    nb = len(cfg["segs"])
    grow = 2.0 if mode == "fwdbwd" else 1.0
    if method == "dense_mask_sdpa":
        return cfg["H"] * float(N) * N * 6 + 8 * x * grow
    if method == "manual":
        scores = sum(
            cfg["B"] * cfg["H"] * (N / r) * min(w, N) / r * 4
            for w, r in zip(cfg["segs"], cfg["rates"], strict=True)
        )
        return 4 * scores * grow + (4 + 6 * nb) * x * grow
    if method in ("native", "dense_causal_sdpa"):
        return 6 * x * grow
    return (4 + 6 * nb) * x * grow


def memory_scaling(method: str) -> int:
    """Exponent of N in the method's memory."""
    return 2 if method == "dense_mask_sdpa" else 1


# ------------------------------------------------------------------------------------------------
# The alternatives, in plain PyTorch
# ------------------------------------------------------------------------------------------------


def _to_bhnd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()  # (B, N, H, D) -> (B, H, N, D)


def dense_mask(
    N: int, H: int, segs: Sequence[int], rates: Sequence[int], causal: bool, device: torch.device
) -> torch.Tensor:
    """(1, H, N, N) float32 additive mask: log(multiplicity) of each pair, -inf where none."""
    pos = torch.arange(N, device=device)
    mask = torch.empty(1, H, N, N, device=device, dtype=torch.float32)
    for h in range(H):
        count = torch.zeros(N, N, device=device, dtype=torch.float32)
        for w, r in zip(segs, rates, strict=True):
            cov = (pos % w) % r == h % r  # (N,)
            seg = pos // w
            count += (cov[:, None] & cov[None, :] & (seg[:, None] == seg[None, :])).float()
        if causal:
            count.tril_()
        mask[0, h] = count.log_()  # log(0) = -inf
        del count
    return mask


def _sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """SDPA on (G, H, L, D) that also returns the log-sum-exp (G, H, L), float32."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., : q.shape[2]]


def _strided_take(t: torch.Tensor, S: int, c: int, r: int, o: int) -> torch.Tensor:
    """(B, S*c*r, H, D) -> (B*S, heads o::r, c, D): phase o of every segment, as one copy."""
    B, _, H, D = t.shape
    x = t.view(B, S, c, r, H, D)[:, :, :, o, o::r]  # (B, S, c, nh, D)
    return x.permute(0, 1, 3, 2, 4).reshape(B * S, x.shape[3], c, D)


def _index_take(t: torch.Tensor, idx: torch.Tensor, heads: torch.Tensor, S: int, c: int) -> torch.Tensor:
    """(B, N, H, D) -> (B*S, len(heads), c, D): positions idx (S*c of them) of the given heads."""
    B, _, _, D = t.shape
    x = t.index_select(1, idx).index_select(2, heads)  # (B, S*c, nh, D)
    return x.view(B, S, c, len(heads), D).permute(0, 1, 3, 2, 4).reshape(B * S, len(heads), c, D)


def gather_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: Sequence[int], rates: Sequence[int], causal: bool
) -> torch.Tensor:
    """Gather + SDPA per branch and head phase, scatter, merge by log-sum-exp. (B, N, H, D) in and out.

    Where the segments tile the sequence (w | N, r | w) and there is no GQA, the covered positions of
    phase o are the strided view x.view(B, N/w, w/r, r, H, D)[:, :, :, o, o::r]; otherwise they are
    gathered with index_select (a ragged last segment is its own call).
    """
    B, N, H, D = q.shape
    G = H // k.shape[2]
    dev = q.device
    outs, lses = [], []
    for w_branch, r in zip(segs, rates, strict=True):
        w = min(w_branch, N)
        out_b = torch.zeros(B, N, H, D, device=dev, dtype=q.dtype)
        lse_b = torch.full((B, N, H), float("-inf"), device=dev, dtype=torch.float32)
        if N % w == 0 and w % r == 0 and G == 1:
            S, c = N // w, w // r
            for o in range(min(r, H)):
                nh = len(range(o, H, r))
                o_g, l_g = _sdpa_with_lse(*(_strided_take(t, S, c, r, o) for t in (q, k, v)), causal)
                out_b.view(B, S, c, r, H, D)[:, :, :, o, o::r] = o_g.view(B, S, nh, c, D).permute(
                    0, 1, 3, 2, 4
                )
                lse_b.view(B, S, c, r, H)[:, :, :, o, o::r] = (
                    l_g.view(B, S, nh, c).permute(0, 1, 3, 2).float()
                )
        else:
            nfull, rem = divmod(N, w)
            for o in range(min(r, H)):
                heads = torch.arange(o, H, r, device=dev)
                pieces = []
                if nfull and o < w:
                    pieces.append(torch.arange(nfull * w, device=dev).view(nfull, w)[:, o::r])
                if rem > o:
                    pieces.append(torch.arange(nfull * w + o, N, r, device=dev).view(1, -1))
                for pos in pieces:  # (S, c): S segments of c covered positions
                    S, c = pos.shape
                    idx, nh = pos.reshape(-1), len(heads)
                    o_g, l_g = _sdpa_with_lse(
                        _index_take(q, idx, heads, S, c),
                        _index_take(k, idx, heads // G, S, c),
                        _index_take(v, idx, heads // G, S, c),
                        causal,
                    )
                    o_g = o_g.view(B, S, nh, c, D).permute(0, 1, 3, 2, 4).reshape(B, S * c, nh, D)
                    l_g = l_g.view(B, S, nh, c).permute(0, 1, 3, 2).reshape(B, S * c, nh)
                    out_b[:, idx[:, None], heads[None, :]] = o_g
                    lse_b[:, idx[:, None], heads[None, :]] = l_g.float()
        outs.append(out_b)
        lses.append(lse_b)
    lse = torch.stack(lses)  # (k, B, N, H)
    m = lse.amax(0).clamp_min(torch.finfo(torch.float32).min)  # finite where no branch covers
    weights = torch.exp(lse - m)  # (k, B, N, H)
    total = weights.sum(0).clamp_min(torch.finfo(torch.float32).tiny)
    out = outs[0] * (weights[0] / total)[..., None].to(q.dtype)
    for o_b, wt in zip(outs[1:], weights[1:], strict=True):
        out = out + o_b * (wt / total)[..., None].to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------------
# One case, in a subprocess
# ------------------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _build(
    method: str, spec: dict, q, k, v
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The method as fn(q, k, v) -> out; its inputs keep the layout the method wants."""
    segs, rates, causal = spec["segs"], spec["rates"], spec["causal"]
    import torch.nn.functional as F

    if method in BACKENDS:
        import dilated_attention

        return lambda q, k, v: dilated_attention.dilated_attention(
            q, k, v, segs, rates, is_causal=causal, backend=method
        )
    gqa = q.shape[1] != k.shape[1] if method != "gather_sdpa" else False
    if method == "dense_causal_sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if method == "dense_mask_sdpa":
        mask = dense_mask(spec["N"], spec["H"], segs, rates, causal, q.device).to(q.dtype)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if method == "gather_sdpa":
        return lambda q, k, v: gather_sdpa(q, k, v, segs, rates, causal)
    raise ValueError(f"unknown method {method!r}")


def run_case(spec: dict) -> dict:
    """Time spec["method"] for each mode in spec["modes"]; returns {mode: {...}}."""
    logging.getLogger("dilated_attention").setLevel(logging.WARNING)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    dev = torch.device(spec["device"])
    dtype = DTYPES[spec["dtype"]]
    B, N, H, Hkv, D = spec["B"], spec["N"], spec["H"], spec["Hkv"], spec["D"]
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    dense = spec["method"] in ("dense_causal_sdpa", "dense_mask_sdpa")

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        shape_q, shape_kv = ((B, H, n, D), (B, Hkv, n, D)) if dense else ((B, n, H, D), (B, n, Hkv, D))
        return tuple(
            torch.randn(s, generator=g, device=dev, dtype=dtype)
            for s in (shape_q, shape_kv, shape_kv, shape_q)
        )

    # One small call first, so that loading libraries and starting thread pools count neither as
    # the method's memory nor as its time.
    n_small = min(N, 256)
    q, k, v, dout = inputs(n_small)
    fn = _build(spec["method"], {**spec, "N": n_small}, q, k, v)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    fn(qg, kg, vg).backward(dout)
    del fn, qg, kg, vg
    q, k, v, dout = inputs(N)

    def sync() -> None:
        lib.sync(dev)

    sync()
    base = torch.cuda.memory_allocated(dev) if cuda else _status_kb("VmRSS")
    fn = _build(spec["method"], spec, q, k, v)
    results = {}
    for mode in spec["modes"]:
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        else:
            _reset_peak_rss()
        times = []
        for i in range(spec["warmup"] + spec["repeats"]):
            if mode == "fwd":
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = fn(q, k, v)
                sync()
                t = time.perf_counter() - t0
            else:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                sync()
                t0 = time.perf_counter()
                out = fn(qg, kg, vg)
                out.backward(dout)
                sync()
                t = time.perf_counter() - t0
                del qg, kg, vg
            del out
            if i >= spec["warmup"]:
                times.append(t)
        peak = (torch.cuda.max_memory_allocated(dev) if cuda else _status_kb("VmHWM")) - base
        times.sort()
        results[mode] = {
            "ms_median": 1e3 * times[len(times) // 2],
            "ms_min": 1e3 * times[0],
            "ms_max": 1e3 * times[-1],
            "repeats": len(times),
            "peak_bytes": int(peak),
        }
    return results


def _worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        res = {"ok": True, "results": run_case(spec)}
    except torch.OutOfMemoryError as exc:  # only CUDA raises this; CPU OOM kills the process
        res = {"ok": False, "error": f"out of memory: {exc}".splitlines()[0][:300]}
    except Exception as exc:
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    print("RESULT " + json.dumps(res), flush=True)


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    if p.returncode < 0:
        return {"ok": False, "error": f"killed by signal {-p.returncode} (out of memory?)"}
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"ok": False, "error": f"exit code {p.returncode}: {tail[:300]}"}


def check_alternatives(cfg: dict, N: int = 512) -> dict:
    """Max abs difference of dense_mask_sdpa and gather_sdpa from the native op at a small N (forward)."""
    import torch.nn.functional as F

    import dilated_attention

    dev = torch.device(cfg["device"])
    g = torch.Generator(device=dev).manual_seed(1)
    H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]
    segs = [min(w, N // 2) for w in cfg["segs"]]
    rates = [min(r, w) for r, w in zip(cfg["rates"], segs, strict=True)]
    q = torch.randn(1, N, H, D, generator=g, device=dev)
    k, v = (torch.randn(1, N, Hkv, D, generator=g, device=dev) for _ in range(2))
    ref = dilated_attention.dilated_attention(q, k, v, segs, rates, is_causal=cfg["causal"], backend="native")
    mask = dense_mask(N, H, segs, rates, cfg["causal"], dev)
    dense = F.scaled_dot_product_attention(
        _to_bhnd(q), _to_bhnd(k), _to_bhnd(v), attn_mask=mask, enable_gqa=H != Hkv
    ).transpose(1, 2)
    gathered = gather_sdpa(q, k, v, segs, rates, cfg["causal"])
    return {
        "N": N,
        "segments": segs,
        "rates": rates,
        "dense_mask_sdpa_max_abs_err": (dense - ref).abs().max().item(),
        "gather_sdpa_max_abs_err": (gathered - ref).abs().max().item(),
    }


# ------------------------------------------------------------------------------------------------
# Machine, matmul rate, methods
# ------------------------------------------------------------------------------------------------


def memory_budget(device: torch.device, fraction: float) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * fraction
    with open("/proc/meminfo") as f:
        m = re.search(r"MemAvailable:\s+(\d+)", f.read())
    return int(m.group(1)) * 1024 * fraction


def runnable_backends(device: torch.device, dtype: torch.dtype, cfg: dict) -> tuple[list[str], dict]:
    """The project's backends that can run these inputs, and why the others cannot."""
    try:
        from dilated_attention.backends import BACKEND_NAMES, BackendRequest, backend_reasons

        req = BackendRequest(
            device=device, dtype=dtype, head_dim=cfg["D"], num_heads=cfg["H"], num_kv_heads=cfg["Hkv"]
        )
        reasons = backend_reasons(req)
        return [n for n in BACKEND_NAMES if not reasons[n]], {n: r for n, r in reasons.items() if r}
    except Exception as exc:
        log.warning("cannot ask dilated_attention.backends which backends run (%s); trying native only", exc)
        return ["native"], {}


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------


def _fmt_n(n: int) -> str:
    if n % (K * K) == 0:
        return f"{n // (K * K)}M"
    if n % K == 0:
        return f"{n // K}K"
    return str(n)


def _skip_reason(
    method: str, N: int, cfg: dict, args, budget: float, last: dict, dead: dict
) -> tuple[str | None, float | None]:
    """Why the method is not run at N (or None), and its predicted seconds per call."""
    if method in dead:
        return dead[method], None
    if method in last:
        n0, res0 = last[method]
        scale = method_work(method, N, cfg) / method_work(method, n0, cfg)
        predicted_s = max(r["ms_median"] for r in res0.values()) / 1e3 * scale
        mem = max(r["peak_bytes"] for r in res0.values()) * (N / n0) ** memory_scaling(method)
        if predicted_s > args.max_seconds:
            return f"predicted {predicted_s:.0f} s per call > --max-seconds {args.max_seconds:g}", predicted_s
        if mem > budget:
            return f"predicted peak {mem / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB", predicted_s
        return None, predicted_s
    mem = max(memory_model(method, N, cfg, m) for m in MODES)
    if mem > budget:
        return f"estimated peak {mem / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB", None
    return None, None


def _combine(rounds: list[dict]) -> dict:
    """Results of several rounds of one case: the median of the rounds' medians, the extremes."""
    out = {}
    for mode in rounds[0]:
        rs = [r[mode] for r in rounds]
        meds = sorted(r["ms_median"] for r in rs)
        out[mode] = {
            "ms_median": meds[len(meds) // 2],
            "ms_min": min(r["ms_min"] for r in rs),
            "ms_max": max(r["ms_max"] for r in rs),
            "repeats": sum(r["repeats"] for r in rs),
            "rounds": len(rs),
            "peak_bytes": max(r["peak_bytes"] for r in rs),
        }
    return out


def rounds_at(N: int, suite: str, args) -> int:
    """Interleaved rounds of the cases at N: more where the targets are checked."""
    return args.target_rounds if suite == "sweep" and 8 * K <= N <= 64 * K else args.rounds


def run_sweep(
    suite: str, methods: list[str], ns: list[int], cfg: dict, args, budget: float, pbar
) -> list[dict]:
    """Every method at every N. N is the outer loop and each round runs every method once, in a fresh
    subprocess, so that methods are measured side by side and a passing load disturbs all of them."""
    rows: list[dict] = []
    last: dict[str, tuple[int, dict]] = {}  # method -> (N, results) of its last success
    dead: dict[str, str] = {}  # method -> why larger N are not tried
    for N in ns:
        pairs = attention_pairs(N, cfg["H"], cfg["segs"], cfg["rates"], cfg["causal"]) * cfg["B"]
        rounds = rounds_at(N, suite, args)
        todo: dict[str, dict] = {}
        bases: dict[str, dict] = {}
        for method in methods:
            bases[method] = {
                "suite": suite,
                "method": method,
                "kind": "backend" if method in BACKENDS else "alternative",
                "N": N,
                **{k_: cfg[k_] for k_ in ("device", "dtype", "B", "H", "Hkv", "D", "causal")},
                "segments": "/".join(map(str, cfg["segs"])),
                "rates": "/".join(map(str, cfg["rates"])),
                "pairs": pairs,
            }
            reason, predicted_s = _skip_reason(method, N, cfg, args, budget, last, dead)
            if reason is not None:
                for mode in MODES:
                    rows.append({**bases[method], "mode": mode, "status": "skipped", "reason": reason})
                pbar.update(rounds)
                continue
            slow = predicted_s is not None and predicted_s > args.slow_seconds
            spec = {
                **cfg,
                "method": method,
                "N": N,
                "modes": list(MODES),
                "threads": args.threads,
                "warmup": 0 if slow else args.warmup,
                "repeats": 1 if slow else args.repeats,
            }
            timeout = args.case_timeout
            if predicted_s is not None:
                timeout = min(timeout, 120 + 8 * predicted_s * (spec["warmup"] + spec["repeats"]))
            todo[method] = {"spec": spec, "timeout": timeout, "results": [], "loads": []}
        for _ in range(rounds):
            for method, job in todo.items():
                if method in dead:
                    pbar.update(1)
                    continue
                pbar.set_description(f"{suite} {method} N={_fmt_n(N)}")
                job["loads"].append(os.getloadavg()[0])
                res = run_in_subprocess(job["spec"], job["timeout"])
                pbar.update(1)
                if res["ok"]:
                    job["results"].append(res["results"])
                else:
                    dead[method] = f"failed at N={_fmt_n(N)}: {res['error']}"
                    log.warning("%s N=%d: %s", method, N, res["error"])
        for method, job in todo.items():
            if method in dead and not job["results"]:
                for mode in MODES:
                    rows.append({**bases[method], "mode": mode, "status": "error", "reason": dead[method]})
                continue
            combined = _combine(job["results"])
            last[method] = (N, combined)
            for mode, r in combined.items():
                sec = r["ms_median"] / 1e3
                rows.append(
                    {
                        **bases[method],
                        "mode": mode,
                        "status": "ok",
                        "reason": "",
                        **r,
                        "tokens_per_s": cfg["B"] * N / sec,
                        "useful_tflops": attention_flops(pairs, cfg["D"], backward=mode != "fwd")
                        / sec
                        / 1e12,
                        "bytes_per_token": r["peak_bytes"] / (cfg["B"] * N),
                        "load1": round(max(job["loads"]), 2),
                    }
                )
    return rows


# ------------------------------------------------------------------------------------------------
# Checks, tables, files
# ------------------------------------------------------------------------------------------------


def _get(rows: list[dict], method: str, N: int, mode: str, suite: str | None = None) -> dict | None:
    for r in rows:
        if (
            r["method"] == method
            and r["N"] == N
            and r["mode"] == mode
            and r["status"] == "ok"
            and (suite is None or r["suite"] == suite)
        ):
            return r
    return None


def target_checks(
    rows: list[dict], mm_flops: float, target_ns: list[int], mem_ns: tuple[int, int], scale_n: int
) -> dict:
    """The CPU kernel's targets, computed from the rows of this run."""
    checks: dict[str, Any] = {"mm_tflops": mm_flops / 1e12, "speed": [], "memory": None, "scale": None}
    for N in target_ns:
        nat = _get(rows, "native", N, "fwdbwd", "sweep")
        natf = _get(rows, "native", N, "fwd", "sweep")
        alts = [
            r
            for r in rows
            if r["suite"] == "sweep"
            and r["N"] == N
            and r["mode"] == "fwdbwd"
            and r["status"] == "ok"
            and r["method"] != "native"
        ]
        best = min(alts, key=lambda r: r["ms_median"]) if alts else None
        checks["speed"].append(
            {
                "N": N,
                "native_fwdbwd_ms": nat["ms_median"] if nat else None,
                "fastest_alternative": best["method"] if best else None,
                "alternative_fwdbwd_ms": best["ms_median"] if best else None,
                "speedup": best["ms_median"] / nat["ms_median"] if (nat and best) else None,
                "native_fwd_tflops": natf["useful_tflops"] if natf else None,
                "fwd_vs_mm": natf["useful_tflops"] * 1e12 / mm_flops if natf else None,
                # The alternative's forward+backward FLOP rate against torch.mm, and so the speedup a
                # native kernel would reach running its forward+backward at torch.mm's rate.
                "alternative_vs_mm": best["useful_tflops"] * 1e12 / mm_flops if best else None,
            }
        )
    small = _get(rows, "native", mem_ns[0], "fwdbwd")
    large = _get(rows, "native", mem_ns[1], "fwdbwd")
    if small and large:
        checks["memory"] = {
            "N_small": mem_ns[0],
            "N_large": mem_ns[1],
            "bytes_per_token_small": small["bytes_per_token"],
            "bytes_per_token_large": large["bytes_per_token"],
            "ratio": large["bytes_per_token"] / small["bytes_per_token"],
        }
    sf, sb = _get(rows, "native", scale_n, "fwd", "scale"), _get(rows, "native", scale_n, "fwdbwd", "scale")
    if sf and sb:
        checks["scale"] = {
            "N": scale_n,
            "H": sb["H"],
            "fwd_s": sf["ms_median"] / 1e3,
            "fwdbwd_s": sb["ms_median"] / 1e3,
            "peak_gib": sb["peak_bytes"] / 2**30,
            "fwd_tflops": sf["useful_tflops"],
            "fwdbwd_tflops": sb["useful_tflops"],
        }
    return checks


def print_checks(checks: dict, cfg: dict) -> None:
    print(
        f"\nCPU targets ({cfg['dtype']}, B={cfg['B']}, H={cfg['H']}, D={cfg['D']}, w={cfg['segs']}, r={cfg['rates']}; "
        f"torch.mm 2048x2048 float32: {checks['mm_tflops'] * 1e3:.0f} GFLOP/s)"
    )
    print(
        f"{'N':>6}  {'native f+b ms':>13}  {'fastest alternative':>22}  {'its f+b ms':>10}  {'speedup':>7}  "
        f"{'native fwd GFLOP/s':>18}  {'fwd/mm':>6}  {'alt f+b/mm':>10}"
    )
    for s in checks["speed"]:

        def f(x, spec):
            return format(x, spec) if x is not None else "-"

        print(
            f"{_fmt_n(s['N']):>6}  {f(s['native_fwdbwd_ms'], '13.0f')}  {s['fastest_alternative'] or '-':>22}  "
            f"{f(s['alternative_fwdbwd_ms'], '10.0f')}  {f(s['speedup'], '6.2f')}x  "
            f"{f(s['native_fwd_tflops'] * 1e3 if s['native_fwd_tflops'] else None, '18.0f')}  "
            f"{f(s['fwd_vs_mm'] * 100 if s['fwd_vs_mm'] else None, '5.0f')}%  "
            f"{f(s.get('alternative_vs_mm') * 100 if s.get('alternative_vs_mm') else None, '9.0f')}%"
        )
    sp = [s["speedup"] for s in checks["speed"] if s["speedup"]]
    fm = [s["fwd_vs_mm"] for s in checks["speed"] if s["fwd_vs_mm"]]
    if sp:
        print(
            f"speedup over the fastest alternative: min {min(sp):.2f}x (target >= 2x: {'met' if min(sp) >= 2 else 'NOT met'})"
        )
    alt = [s["alternative_vs_mm"] for s in checks["speed"] if s.get("alternative_vs_mm")]
    if sp and alt:
        print(
            f"the fastest alternative runs its forward+backward at up to {max(alt) * 100:.0f}% of torch.mm's rate: "
            f"2x over it needs the native forward+backward at {2 * max(alt) * 100:.0f}% of torch.mm's rate"
        )
    if fm:
        print(
            f"native forward / matmul rate: min {min(fm) * 100:.0f}% (target >= 50%: {'met' if min(fm) >= 0.5 else 'NOT met'})"
        )
    m = checks["memory"]
    if m:
        print(
            f"peak bytes/token of native fwd+bwd: {m['bytes_per_token_small']:.0f} at N={_fmt_n(m['N_small'])}, "
            f"{m['bytes_per_token_large']:.0f} at N={_fmt_n(m['N_large'])}: ratio {m['ratio']:.2f} "
            f"(target <= 1.2: {'met' if m['ratio'] <= 1.2 else 'NOT met'})"
        )
    s = checks["scale"]
    if s:
        print(
            f"scale: native at N={_fmt_n(s['N'])} (B=1, H={s['H']}): forward {s['fwd_s']:.1f} s, forward+backward "
            f"{s['fwdbwd_s']:.1f} s, peak {s['peak_gib']:.2f} GiB"
        )


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'suite':<6} {'method':<18} {'N':>6} {'mode':<7} {'ms':>10} {'tokens/s':>10} {'TFLOP/s':>8} "
        f"{'peak MiB':>9}  status"
    )
    for r in rows:
        if r["status"] == "ok":
            print(
                f"{r['suite']:<6} {r['method']:<18} {_fmt_n(r['N']):>6} {r['mode']:<7} {r['ms_median']:>10.1f} "
                f"{r['tokens_per_s']:>10.0f} {r['useful_tflops']:>8.3f} {r['peak_bytes'] / 2**20:>9.0f}  ok"
            )
        elif r["mode"] == "fwd":
            print(
                f"{r['suite']:<6} {r['method']:<18} {_fmt_n(r['N']):>6} {'':<7} {'':>10} {'':>10} {'':>8} {'':>9}  "
                f"{r['status']}: {r['reason']}"
            )


CSV_FIELDS = [
    "suite",
    "method",
    "kind",
    "mode",
    "device",
    "dtype",
    "B",
    "N",
    "H",
    "Hkv",
    "D",
    "segments",
    "rates",
    "causal",
    "status",
    "reason",
    "ms_median",
    "ms_min",
    "ms_max",
    "repeats",
    "rounds",
    "tokens_per_s",
    "pairs",
    "useful_tflops",
    "peak_bytes",
    "bytes_per_token",
    "load1",
]


def write_outputs(path: str, rows: list[dict], meta: dict, checks: dict | None) -> list[str]:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "checks": checks, "rows": rows}, f, indent=1)
    written = [path + ".csv", path + ".json"]
    if plot(path + ".png", rows, meta):
        written.append(path + ".png")
    return written


def plot(path: str, rows: list[dict], meta: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return False
    ok = [r for r in rows if r["status"] == "ok" and r["suite"] == "sweep"]
    if not ok:
        return False
    methods = list(dict.fromkeys(r["method"] for r in ok))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5.2))
    for i, m in enumerate(methods):
        color = f"C{i}"
        for mode, style in (("fwdbwd", "-"), ("fwd", "--")):
            pts = sorted((r["N"], r["ms_median"]) for r in ok if r["method"] == m and r["mode"] == mode)
            if pts:
                ax_t.plot(
                    *zip(*pts, strict=True),
                    style,
                    marker="o",
                    ms=3,
                    color=color,
                    label=f"{m} {'fwd+bwd' if mode == 'fwdbwd' else 'fwd'}",
                )
        pts = sorted(
            (r["N"], r["peak_bytes"] / 2**20)
            for r in ok
            if r["method"] == m and r["mode"] == "fwdbwd" and r["peak_bytes"] > 0
        )
        if pts:
            ax_m.plot(*zip(*pts, strict=True), "-", marker="o", ms=3, color=color, label=f"{m} fwd+bwd")
    scale = [r for r in rows if r["status"] == "ok" and r["suite"] == "scale"]
    for mode, marker in (("fwdbwd", "*"), ("fwd", "x")):
        pts = sorted((r["N"], r["ms_median"]) for r in scale if r["mode"] == mode)
        if pts:
            ax_t.plot(
                *zip(*pts, strict=True),
                marker,
                ms=9,
                color="k",
                label=f"native {'fwd+bwd' if mode == 'fwdbwd' else 'fwd'}, H={scale[0]['H']}",
            )
    pts = sorted((r["N"], r["peak_bytes"] / 2**20) for r in scale if r["mode"] == "fwdbwd")
    if pts:
        ax_m.plot(*zip(*pts, strict=True), "*", ms=9, color="k", label=f"native fwd+bwd, H={scale[0]['H']}")
    for ax, ylabel in ((ax_t, "time (ms)"), (ax_m, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7, ncol=2)
    ax_m.legend(fontsize=7)
    cfg = ok[0]
    where = meta.get("gpu") or f"{meta.get('cpu')} ({meta.get('torch_threads')} threads)"
    fig.suptitle(
        f"dilated attention, {cfg['dtype']}, B={cfg['B']} H={cfg['H']} D={cfg['D']} w={cfg['segments']} "
        f"r={cfg['rates']}{' causal' if cfg['causal'] else ''}\n{where}, torch {meta['torch']}, "
        f"{meta['date'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", type=lib.device, default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--n",
        type=lib.positive_int_list,
        default=None,
        help="sequence lengths, e.g. 8k,16k (default 1K..256K on CPU, 1K..4M on CUDA)",
    )
    p.add_argument("--batch", "-B", type=lib.positive_int, default=1)
    p.add_argument("--heads", "-H", type=lib.positive_int, default=8)
    p.add_argument(
        "--kv-heads", type=lib.positive_int, default=None, help="key/value heads (default: --heads)"
    )
    p.add_argument("--dim", "-D", type=lib.positive_int, default=64, help="head dim")
    p.add_argument("--segments", type=lib.positive_int_list, default=[2048, 4096, 8192])
    p.add_argument("--rates", type=lib.positive_int_list, default=[1, 2, 4])
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default float32 (CPU), bfloat16 (CUDA)"
    )
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated subset of {', '.join(BACKENDS + ALTERNATIVES)} (default: all that run)",
    )
    p.add_argument("--repeats", type=lib.positive_int, default=3, help="timed calls per case and round")
    p.add_argument(
        "--rounds", type=lib.positive_int, default=1, help="interleaved rounds per case (median of rounds)"
    )
    p.add_argument(
        "--target-rounds",
        type=lib.positive_int,
        default=3,
        help="rounds for N in 8K..64K, where the targets are checked",
    )
    p.add_argument("--warmup", type=lib.nonnegative_int, default=1)
    p.add_argument(
        "--threads", type=lib.positive_int, default=None, help="torch threads (default: torch's default)"
    )
    p.add_argument(
        "--max-seconds",
        type=lib.positive_float,
        default=60.0,
        help="skip a case predicted to take longer per call",
    )
    p.add_argument(
        "--slow-seconds",
        type=lib.nonnegative_float,
        default=15.0,
        help="a case predicted to take longer per call runs once, without warm-up",
    )
    p.add_argument(
        "--case-timeout",
        type=lib.positive_float,
        default=1800.0,
        help="kill a case's subprocess after this long",
    )
    p.add_argument(
        "--mem-fraction",
        type=lib.fraction,
        default=0.75,
        help="of the available memory, the most a case may use",
    )
    p.add_argument(
        "--scale-n",
        type=lib.nonnegative_int_list,
        default=None,
        help="N of the native-only scale run (default 1M on CPU, 1M,4M on CUDA; 0 to skip)",
    )
    p.add_argument("--scale-heads", type=lib.positive_int, default=4)
    p.add_argument(
        "--from-json",
        metavar="PATH",
        default=None,
        help="measure nothing: print the table and target checks of a saved run and write its files again",
    )
    p.add_argument("--quick", action="store_true", help="N = 1K..8K, one repeat, no scale run")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default=None, help="file name stem (default: device and machine)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing results of the same name (default: write new ones beside them)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None or args.from_json:
        return args
    lib.check_branches(p, args.segments, args.rates)
    lib.check_heads(p, args.heads, args.kv_heads)
    lib.check_head_dim(p, args.dim, "--dim")
    if args.methods is not None:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in BACKENDS + ALTERNATIVES]
        if unknown or not wanted:
            p.error(
                f"--methods {args.methods!r}: expected some of {', '.join(BACKENDS + ALTERNATIVES)}"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        _worker_main(args.worker)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.from_json:
        return report_saved(args.from_json, args.out, args.tag, args.overwrite)
    from tqdm import tqdm

    device = torch.device(args.device)  # checked by parse_args
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg = {
        "device": str(device),
        "dtype": dtype_name,
        "B": args.batch,
        "H": args.heads,
        "Hkv": args.kv_heads or args.heads,
        "D": args.dim,
        "segs": args.segments,
        "rates": args.rates,
        "causal": args.causal,
    }
    if args.quick:
        ns, scale_ns, args.repeats, args.warmup, args.target_rounds = [K, 2 * K, 4 * K, 8 * K], [], 1, 1, 1
    else:
        top = 4 * K * K if device.type == "cuda" else 256 * K
        ns = args.n or [2**i for i in range(10, int(math.log2(top)) + 1)]
        scale_ns = (
            args.scale_n
            if args.scale_n is not None
            else ([K * K] if device.type == "cpu" else [K * K, 4 * K * K])
        )
    if args.n:
        ns = args.n
    scale_ns = [n for n in scale_ns if n > 0]

    backends, why_not = runnable_backends(device, DTYPES[dtype_name], cfg)
    for name, reasons in why_not.items():
        log.info("backend %s cannot run here: %s", name, "; ".join(reasons))
    methods = backends + list(ALTERNATIVES)
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]  # checked by parse_args
        for m in wanted:
            if m in BACKENDS and m not in backends:
                log.warning("backend %s cannot run here (%s): left out", m, "; ".join(why_not.get(m, [])))
        methods = [m for m in wanted if m in ALTERNATIVES or m in backends]

    meta = lib.machine_info(device)
    budget = memory_budget(device, args.mem_fraction)
    meta.update(
        {
            "load_at_start": os.getloadavg(),
            "memory_budget_gib": round(budget / 2**30, 1),
            "config": cfg,
            "methods": methods,
            "repeats": args.repeats,
            "warmup": args.warmup,
        }
    )
    if "native" in backends and cfg["dtype"] == "float32":
        meta["alternatives_vs_native"] = check_alternatives(cfg)
        log.info("alternatives against the native op at small N: %s", meta["alternatives_vs_native"])
    mm_before = matmul_flops(device)
    log.info(
        "machine: %s; torch.mm 2048x2048 float32: %.0f GFLOP/s; methods: %s",
        meta.get("gpu") or meta.get("cpu"),
        mm_before / 1e9,
        ", ".join(methods),
    )

    scale_cfg = {**cfg, "H": args.scale_heads, "Hkv": args.scale_heads}
    total = sum(rounds_at(n, "sweep", args) for n in ns) * len(methods)
    total += sum(rounds_at(n, "scale", args) for n in scale_ns) if "native" in methods else 0
    with tqdm(total=total, unit="case", dynamic_ncols=True) as pbar:
        rows = run_sweep("sweep", methods, ns, cfg, args, budget, pbar)
        if "native" in methods and scale_ns:
            rows += run_sweep("scale", ["native"], scale_ns, scale_cfg, args, budget, pbar)
    mm_after = matmul_flops(device)
    mm = (mm_before + mm_after) / 2
    meta.update(
        {
            "load_at_end": os.getloadavg(),
            "mm_gflops_start": round(mm_before / 1e9, 1),
            "mm_gflops_end": round(mm_after / 1e9, 1),
        }
    )

    report(rows, meta, mm, cfg, output_stem(args.out, args.tag or lib.machine_tag(meta), args.overwrite))
    return 0


def output_stem(out: str, tag: str, overwrite: bool = False) -> str:
    """``<out>/<tag>``, or beside it with the time in the name where results of that name exist."""
    return lib.fresh_stem(os.path.join(out, tag), (".csv", ".json", ".png", ".txt"), overwrite)


def report(rows: list[dict], meta: dict, mm: float, cfg: dict, stem: str) -> None:
    """Print the table and the target checks of a run, and write its CSV, JSON and plot."""
    ns = sorted({r["N"] for r in rows if r["suite"] == "sweep"})
    target_ns = [n for n in ns if 8 * K <= n <= 64 * K]
    checks = target_checks(rows, mm, target_ns, (16 * K, 256 * K), K * K)
    print_table(rows)
    print_checks(checks, cfg)
    for path in write_outputs(stem, rows, meta, checks):
        print(f"wrote {path}")


def report_saved(path: str, out: str, tag: str | None, overwrite: bool = False) -> int:
    """--from-json: the report of a run saved as JSON, with this version's checks."""
    try:
        with open(path) as f:
            data = json.load(f)
        meta, rows = data["meta"], data["rows"]
        mm = (meta["mm_gflops_start"] + meta["mm_gflops_end"]) / 2 * 1e9
        cfg = meta["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"--from-json {path}: not a saved benchmark run ({type(exc).__name__}: {exc})"
        ) from None
    report(rows, meta, mm, cfg, output_stem(out, tag or lib.machine_tag(meta), overwrite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
