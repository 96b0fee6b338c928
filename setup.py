"""Build of the dilated_attention._C extension.

The CPU kernels always build. The CUDA kernels build when nvcc and a CUDA-enabled torch are
present, or when FORCE_CUDA=1; DILATED_ATTENTION_CPU_ONLY=1 skips them. TORCH_CUDA_ARCH_LIST is
honoured (see ``_default_arch_list`` for the default).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _nvcc_version() -> tuple[int, int] | None:
    if CUDA_HOME is None:
        return None
    try:
        text = subprocess.check_output([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _default_arch_list() -> str:
    """6.0-9.0 by default; CUDA 13 dropped sm_5x-sm_7.0, so it starts at 7.5 there."""
    version = _nvcc_version()
    if version is not None and version[0] >= 13:
        return "7.5;8.0;8.6;8.9;9.0"
    return "6.0;6.1;7.0;7.5;8.0;8.6;8.9;9.0"


def _want_cuda() -> bool:
    if _flag("DILATED_ATTENTION_CPU_ONLY"):
        return False
    if _flag("FORCE_CUDA"):
        return True
    return CUDA_HOME is not None and torch.version.cuda is not None


def _extension():
    cxx = ["-O3", "-fopenmp-simd", "-fno-math-errno"]
    sources = ["csrc/dilated_attention.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    include = [os.path.join(HERE, "csrc")]
    if _want_cuda():
        if CUDA_HOME is None:
            raise RuntimeError("FORCE_CUDA=1 was given but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list())
        print(f"dilated_attention: building CPU and CUDA kernels for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        return CUDAExtension(
            "dilated_attention._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include,
            define_macros=[("DILATED_ATTENTION_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            py_limited_api=False,
        )
    print("dilated_attention: building CPU kernels only (no nvcc with a CUDA-enabled torch, or DILATED_ATTENTION_CPU_ONLY=1)")
    return CppExtension("dilated_attention._C", sources, include_dirs=include, extra_compile_args={"cxx": cxx})


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
