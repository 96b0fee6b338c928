"""Build of the dilated_attention._C extension.

The CPU kernels always build. The CUDA kernels build when nvcc and a CUDA-enabled torch are
present, or when FORCE_CUDA=1; DILATED_ATTENTION_CPU_ONLY=1 skips them. TORCH_CUDA_ARCH_LIST is
honoured (see ``_default_arch_list`` for the default).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import torch
import torch.utils.cpp_extension as cpp_extension
from setuptools import setup
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
    """6.0-9.0 by default; CUDA 13 dropped sm_5x-sm_7.0, so it starts at 7.5 there. The newest
    target also ships as PTX, which the driver compiles for newer GPUs (Blackwell sm_100/sm_120) on
    first use, so that they do not fail with "no kernel image is available"."""
    version = _nvcc_version()
    if version is not None and version[0] >= 13:
        return "7.5;8.0;8.6;8.9;9.0+PTX"
    return "6.0;6.1;7.0;7.5;8.0;8.6;8.9;9.0+PTX"


def _toolkit_root() -> str | None:
    """The CUDA toolkit directory that holds the headers (include/cuda_runtime_api.h).

    torch takes the parent of the ``nvcc`` found on PATH, which is wrong when that ``nvcc`` is a
    wrapper script outside the toolkit (``/usr/local/bin/nvcc`` -> CUDA_HOME=/usr/local); the C++
    sources of the CUDA half then miss the CUDA headers. Ask nvcc where it lives instead.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME]
    nvcc = shutil.which("nvcc") or (os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None)
    if nvcc:
        try:
            dry = subprocess.run(
                [nvcc, "-v", "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=60,
            )
            m = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
            if m:
                candidates.append(os.path.normpath(m.group(1).strip()))
        except (OSError, subprocess.SubprocessError):
            pass
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return root
    return CUDA_HOME


def _want_cuda() -> bool:
    if _flag("DILATED_ATTENTION_CPU_ONLY"):
        return False
    if _flag("FORCE_CUDA"):
        return True
    return CUDA_HOME is not None and torch.version.cuda is not None


def _cxx_flags() -> list[str]:
    """Host compiler flags. OpenMP (the runtime torch itself loads) makes at::parallel_for run on
    torch's intra-op threads; without it the CPU kernels run on one thread. No -ffast-math: the
    kernels keep IEEE NaN/inf semantics."""
    cxx = ["-O3", "-fno-math-errno"]
    if os.name == "posix" and os.uname().sysname == "Linux" and torch.backends.openmp.is_available():
        cxx.append("-fopenmp")
    else:
        cxx.append("-fopenmp-simd")
    return cxx


def _extension():
    cxx = _cxx_flags()
    sources = ["csrc/dilated_attention.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    include = [os.path.join(HERE, "csrc")]
    if _want_cuda():
        if CUDA_HOME is None:
            raise RuntimeError("FORCE_CUDA=1 was given but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        root = _toolkit_root()
        if root and root != CUDA_HOME:
            cpp_extension.CUDA_HOME = root  # read by CUDAExtension and BuildExtension at build time
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _default_arch_list())
        print(
            f"dilated_attention: building CPU and CUDA kernels for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"
        )
        # csrc/cuda: the op's CUDA half (host code in .cpp, kernels in .cu; see docs/cuda.md).
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        nvcc += shlex.split(os.environ.get("DILATED_ATTENTION_NVCC_FLAGS", ""))  # e.g. "-Xptxas -v"
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
        return CUDAExtension(
            "dilated_attention._C",
            sources + cuda_sources,
            include_dirs=include,
            define_macros=[("DILATED_ATTENTION_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            py_limited_api=False,
        )
    print(
        "dilated_attention: building CPU kernels only (no nvcc with a CUDA-enabled torch, or DILATED_ATTENTION_CPU_ONLY=1)"
    )
    return CppExtension(
        "dilated_attention._C", sources, include_dirs=include, extra_compile_args={"cxx": cxx}
    )


class _BuildExtension(BuildExtension):
    """torch's build_ext, which also writes ``_build_info.json`` beside the extension: the torch
    and Python it was built against, so that ``dilated_attention._ops`` can say when it runs with
    others (an extension built for another torch fails obscurely, or not at all until it crashes)."""

    def build_extensions(self) -> None:
        super().build_extensions()
        for ext in self.extensions:
            folder = os.path.dirname(self.get_ext_fullpath(ext.name))
            info = {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": ".".join(map(str, sys.version_info[:2])),
            }
            with open(os.path.join(folder, "_build_info.json"), "w") as f:
                json.dump(info, f)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
)
