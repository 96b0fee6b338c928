"""Every instruction set of the CPU kernels against the float64 reference.

The CPU kernels are built once per instruction set (AVX-512, AVX2, baseline) and the widest one the
CPU has runs; DILATED_ATTENTION_CPU_ISA chooses another. Each choice this CPU can run goes through
the reference tests of tests/op/test_op.py in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ISAS = ["baseline", "avx2", "avx512"]
SMALL_CALL = (
    "import torch, dilated_attention as da; q = torch.randn(1, 8, 2, 16); "
    "print(da.dilated_attention(q, q, q, [4, 8], [1, 2]).abs().sum().item())"
)


def _python(code: str, isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DILATED_ATTENTION_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("isa", ISAS)
def test_instruction_set_matches_reference(isa):
    probe = _python(SMALL_CALL, isa)
    if "does not have" in probe.stderr:
        pytest.skip(f"this CPU has no {isa}")
    assert probe.returncode == 0, probe.stderr
    chosen = _python("import dilated_attention; print(dilated_attention.op.cpu_isa())", isa)
    assert chosen.stdout.strip() == isa, chosen.stderr
    env = {**os.environ, "DILATED_ATTENTION_CPU_ISA": isa}
    tests = "matches_reference or gradcheck or uncovered or nan_and_inf or multiplicity or softmax_scale"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "test_op.py"),
            "-k",
            tests,
        ],
        env=env,
        cwd=HERE.parents[1],  # the checkout
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@pytest.mark.parametrize("value", ["sse9", "AVX2 ", "avx-512"])
def test_unknown_instruction_set_is_named_in_the_error(value):
    run = _python(SMALL_CALL, value)
    assert run.returncode != 0
    assert "DILATED_ATTENTION_CPU_ISA" in run.stderr and f"'{value}'" in run.stderr


def test_unknown_instruction_set_in_cpu_isa_and_report():
    code = (
        "import dilated_attention\n"
        "from dilated_attention import __main__ as report\n"
        "print(report.environment_report()['extension']['cpu_isa'])\n"
        "dilated_attention.op.cpu_isa()\n"
    )
    run = _python(code, "sse9")
    assert "error: " in run.stdout and "'sse9'" in run.stdout  # the report names it and goes on
    assert "ValueError" in run.stderr and "'sse9'" in run.stderr
