"""Inputs and gradients shared by the tests that compare an implementation with the reference."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch


def make_inputs(
    B: int,
    N: int,
    Hq: int,
    Hkv: int,
    D: int,
    dtype: torch.dtype,
    seed: int = 0,
    requires_grad: bool = True,
    device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """q (B, N, Hq, D), k and v (B, N, Hkv, D): the same values for every dtype and device
    (drawn in float64 on the CPU, then rounded)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v))


def grads(
    out: torch.Tensor,
    lse: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of <out, dout> + <lse, dlse> (lse's -inf entries excluded)."""
    loss = (out.double() * dout.to(out.device)).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        masked = torch.where(finite, lse.double(), torch.zeros_like(lse.double()))
        loss = loss + (masked * dlse.to(lse.device)).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny problems run faster, and steadier on a busy machine, on one thread (import it into a
    test module to apply it there)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def load_script(path: Path):
    """A script that is no package module (benchmarks/, scripts/), imported by its path under its
    file name (dataclasses look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


# What to do about each reason setup.py records for building no CUDA kernels (_build_info.json).
_CUDA_BUILD_HINTS = {
    "no GPU visible": "the build saw no GPU; reinstall with TORCH_CUDA_ARCH_LIST (e.g. "
    '"9.0" for H100) or FORCE_CUDA=1 for every architecture',
    "DILATED_ATTENTION_CPU_ONLY=1": "reinstall without DILATED_ATTENTION_CPU_ONLY",
    "no nvcc with a CUDA-enabled torch": "reinstall with nvcc on PATH and a CUDA build of torch",
}


def cuda_build_reason() -> str:
    """Why the installed extension has no CUDA kernels, from what setup.py recorded beside it
    (``_build_info.json``'s ``cuda_arch_reason``), and how to build them."""
    from dilated_attention.op import library

    info = library._build_info(library._C) if library._C is not None else None
    if info is None:
        return "the extension is not loaded or has no _build_info.json: reinstall it (make install)"
    archs, why = info.get("cuda_arch_list"), info.get("cuda_arch_reason", "unknown")
    if archs:
        return f"built for {archs} ({why}) without this op's CUDA kernels: a stale build? reinstall it"
    hint = _CUDA_BUILD_HINTS.get(why, "see docs/environment.md")
    return f"built with the CPU kernels only ({why}): {hint}"


def needs_cuda_kernels(built: bool) -> pytest.MarkDecorator:
    """Skips a test without a CUDA GPU or without the extension's CUDA kernels (``built``: whether
    the op the test calls has them), saying which is missing and, for the kernels, why the build
    has none."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (none is visible)")
    if not built:
        missing.append(f"the extension's CUDA kernels ({cuda_build_reason()})")
    return pytest.mark.skipif(bool(missing), reason="needs " + " and ".join(missing))


ROOT = Path(__file__).resolve().parents[1]


def cuda_headers() -> Path | None:
    """A directory with cuda_runtime.h, cuda_fp16.h and cuda_bf16.h (no GPU or driver needed):
    CUDA_HOME, CUDA_PATH, torch's CUDA_HOME, /usr/local/cuda or the toolkit of the nvcc on PATH."""
    from torch.utils.cpp_extension import CUDA_HOME

    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME, "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            dry = subprocess.run(
                [nvcc, "-v", "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            for line in (dry.stdout + dry.stderr).splitlines():
                if line.startswith("#$ TOP="):
                    roots.append(line.split("=", 1)[1].strip())
        except (OSError, subprocess.SubprocessError):
            pass
    for root in roots:
        inc = Path(root) / "include" if root else None
        if inc and all((inc / h).exists() for h in ("cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h")):
            return inc
    return None


def build_emulation(runner: str, out_dir: Path, opt: str = "-O1") -> ctypes.CDLL:
    """tests/cuda_emulation/<runner>.cpp compiled with the host C++ compiler for the CPU emulation
    of the CUDA kernels and loaded; skips the test where no compiler or CUDA headers are found."""
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    inc = cuda_headers()
    if cxx is None or inc is None:
        pytest.skip("the CPU emulation of the CUDA kernels needs a C++ compiler and the CUDA headers")
    lib = out_dir / f"{runner}.so"
    cmd = [cxx, "-std=c++17", opt, "-shared", "-fPIC", "-DDA_CUDA_EMULATION", "-Wno-attributes"]
    here = Path(__file__).resolve().parent / "cuda_emulation"
    cmd += [f"-I{ROOT / 'csrc'}", f"-I{here}", f"-I{inc}", *(f"-I{p}" for p in include_paths())]
    cmd += [str(here / f"{runner}.cpp"), "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, f"building the emulation runner {runner} failed:\n{res.stderr[-4000:]}"
    return ctypes.CDLL(str(lib))


ROW_DIMS = 6  # csrc/views/rows_kernel.cuh kRowDims


def row_meta(dst: torch.Tensor, src: torch.Tensor, group: int = 1, group_stride: int = 0) -> list[int]:
    """One (dst, src) pair as tests/cuda_emulation/run_rows.cpp reads it: the element bytes of
    both, dst's sizes and strides and src's, padded in front to ROW_DIMS dims, src's elements
    (0 float32, 1 bfloat16, 2 float16), and an add's group of source rows (src the first) and
    their stride."""
    meta = [dst.element_size(), src.element_size()]
    for t in (dst, src):
        pad = ROW_DIMS - t.dim()
        meta += [1] * pad + list(t.shape) + [0] * pad + list(t.stride())
    source = {torch.bfloat16: 1, torch.float16: 2}.get(src.dtype, 0)
    return [*meta, source, group, group_stride]


def assert_grad_and_vjp_agree(f, ref, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """torch.func's ``grad`` (over q, k, v) and ``vjp`` of the scalar functions ``f`` and ``ref``
    agree (``ref``: the float64 reference)."""
    from torch.func import grad, vjp

    for a, e in zip(grad(f, argnums=(0, 1, 2))(q, k, v), grad(ref, argnums=(0, 1, 2))(q, k, v), strict=True):
        torch.testing.assert_close(a, e)
    (_, pull), (_, pull_ref) = vjp(f, q, k, v), vjp(ref, q, k, v)
    one = torch.ones((), dtype=q.dtype)
    for a, e in zip(pull(one), pull_ref(one), strict=True):
        torch.testing.assert_close(a, e)


# The huge-score cases of the CPU and the emulated CUDA kernels (tests/op/test_op_huge_scores.py,
# tests/cuda/test_cuda_huge_scores.py): (softmax_scale or None for 1/sqrt(D), scale of q and k),
# the largest |score| from ~1e9 to ~1e31 (q . k / sqrt(D) has standard deviation |q| |k|) ...
HUGE_SCORE_MAGNITUDES = [
    pytest.param(1e9, 1.0, id="scale-1e9"),
    pytest.param(1e12, 1.0, id="scale-1e12"),
    pytest.param(1e30, 1.0, id="scale-1e30"),
    pytest.param(None, 3e5, id="inputs-3e5"),
    pytest.param(None, 1e15, id="inputs-1e15"),
]

# ... over (N, Hq, Hkv, segment_lengths, dilation_rates, is_causal).
HUGE_SCORE_GEOMETRIES = [
    pytest.param(40, 2, 2, [16], [1], False, id="one-branch"),
    pytest.param(40, 2, 1, [16], [2], True, id="one-branch-dilated-causal-gqa"),
    pytest.param(40, 2, 2, [8, 16], [1, 2], True, id="two-branches-causal"),
    pytest.param(41, 4, 2, [4, 8, 32], [1, 2, 4], False, id="three-branches-gqa"),
]
