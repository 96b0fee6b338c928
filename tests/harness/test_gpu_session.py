"""scripts/gpu_session.sh, the one GPU command of a short lease: its usage errors, its dry run
(every step named, within the deadline) and its clean skip without a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_usage_errors():
    for args, words in (
        (["--deadline", "soon"], "whole seconds"),
        (["--bogus"], "unknown option '--bogus'"),
        (["a", "b"], "one output folder only"),
    ):
        r = _run(*args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)


def test_dry_run_names_every_step_within_the_deadline(tmp_path):
    """Measurements first (build, the attention alone, the GPT, the profile), the tests last."""
    r = _run(str(tmp_path / "out"), "--dry-run", "--deadline", "575")
    assert r.returncode == 0, r.stderr
    limits = dict(re.findall(r"^(\w+) \((\d+) s\): ", r.stdout, flags=re.M))
    assert list(limits) == ["build", "attn", "gpt", "profile", "views", "check"], r.stdout
    assert sum(int(s) for s in limits.values()) <= 575
    assert int(limits["build"]) >= 150, "the build took 97 s on an H200 at 199db38"
    assert "scripts/gpu_check.sh tests" in r.stdout and "--steps build" in r.stdout
    assert "--steps tests,smoke" in r.stdout and "tests/backends/test_views_driver.py" in r.stdout
    assert "bench_cuda.py --gpt" in r.stdout and "native90" not in r.stdout
    assert "--blocks 16k,64k,128k --compile both --backends dense,auto" in r.stdout
    assert "--profile auto:16k:eager" in r.stdout
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.count("| dry run |") == 6


def test_a_short_deadline_leaves_steps_not_run(tmp_path):
    """A deadline shorter than the measurements' limits leaves the last steps not run."""
    r = _run(str(tmp_path / "out"), "--dry-run", "--deadline", "300")
    assert r.returncode == 1
    assert "| check | not run" in r.stdout


def test_skips_cleanly_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = _run(str(tmp_path / "out"))
    assert r.returncode == 0 and "no CUDA GPU here" in r.stdout
    assert "skipped" in (tmp_path / "out" / "summary.md").read_text()
