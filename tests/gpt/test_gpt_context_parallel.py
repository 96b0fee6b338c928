"""The example trainer with sequence parallelism: ``train.py --context_parallel=2`` on 4 gloo
processes (a ("dp", "cp") = (2, 2) mesh, DDP or FSDP2 on it) trains as one process does on the
same global batch: the same losses step by step, within float32 rounding."""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from test_gpt_example import data_dir, one_thread, tiny_train_args, train  # noqa: F401  (fixtures)

DEADLINE_S = 300.0  # the processes are killed after it (a loaded machine starts them slowly)
STEPS = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: list[str], results: Any) -> None:
    """One process as torchrun starts it: the launcher's environment, then train.main."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        out = train.main(args, log=lambda *_: None)
        results.put((rank, "ok", {"losses": out["losses"], "evals": out["evals"]}))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _launch(world: int, args: list[str]) -> dict[str, Any]:
    """``train.main(args)`` on ``world`` spawned processes; rank 0's summary."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, args, results), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, payload = results.get(timeout=DEADLINE_S)
            if status != "ok":
                pytest.fail(f"rank {rank}:\n{payload}")
            got[rank] = payload
    except multiprocessing.queues.Empty:  # type: ignore[attr-defined]
        pytest.fail(
            f"the {world} processes did not finish within {DEADLINE_S:.0f} s (finished: {sorted(got)})"
        )
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return got[0]


SLOW = os.environ.get("DILATED_ATTENTION_SLOW") == "1"
FSDP2_SLOW = pytest.mark.skipif(not SLOW, reason="a second 4-process run: set DILATED_ATTENTION_SLOW=1")


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp2", marks=FSDP2_SLOW)])
def test_context_parallel_trains_as_one_process(data_dir, tmp_path, parallel):  # noqa: F811
    common = {"max_iters": STEPS, "eval_interval": STEPS, "eval_iters": 1, "learning_rate": 3e-3}
    torch.set_num_threads(1)
    one = train.main(  # one process, the global batch of 2 replicas x 2 rows
        tiny_train_args(data_dir, tmp_path / "one", batch_size=4, **common), log=lambda *_: None
    )
    split = _launch(
        4,
        tiny_train_args(
            data_dir, tmp_path / "cp", batch_size=2, context_parallel=2, parallel=parallel, **common
        ),
    )
    assert [i for i, _ in split["losses"]] == [i for i, _ in one["losses"]] == list(range(STEPS))
    for (i, a), (_, b) in zip(split["losses"], one["losses"], strict=True):
        assert abs(a - b) < 2e-4 * abs(b), f"step {i}: loss {a} with 2 x 2 processes, {b} with one"
    for e_split, e_one in zip(split["evals"], one["evals"], strict=True):
        assert abs(e_split["val"] - e_one["val"]) < 2e-4 * abs(e_one["val"]), (e_split, e_one)


def test_context_parallel_without_a_launcher_says_how_to_start(data_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=r"context_parallel=2 .*torchrun"):
        train.main(tiny_train_args(data_dir, tmp_path, context_parallel=2), log=lambda *_: None)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"context_parallel": 0}, "context_parallel must be >= 1"),
        ({"parallel": "zero3"}, "parallel must be 'ddp' or 'fsdp2'"),
        ({"context_parallel": 2, "attention_backend": "dense"}, "does not support attention_backend='dense'"),
        ({"context_parallel": 2, "dropout": 0.1}, "does not support dropout=0.1"),
    ],
)
def test_bad_context_parallel_settings(data_dir, tmp_path, overrides, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        train.main(tiny_train_args(data_dir, tmp_path, **overrides), log=lambda *_: None)
