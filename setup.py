"""Build of the dilated_attention._C extension.

The CPU kernels always build. The CUDA kernels follow the convention of PyTorch extensions (they
need nvcc and a CUDA-enabled torch):

* ``TORCH_CUDA_ARCH_LIST`` set: for those architectures;
* otherwise, GPUs visible: for the architectures of the visible GPUs (the newest also as PTX);
* otherwise, no GPU: the CPU kernels only, unless ``FORCE_CUDA=1`` (then every architecture of
  ``_default_arch_list``, as for a wheel); the build says so in one line.

``DILATED_ATTENTION_CPU_ONLY=1`` skips the CUDA kernels whatever else is set.
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
sys.path.insert(0, os.path.join(HERE, "scripts"))
import check_libstdcxx  # noqa: E402  (scripts/: the libstdc++ link rule, shared with check_cuda_build.sh)


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


def _visible_arch_list() -> str | None:
    """The compute capabilities of the visible GPUs, ``"8.6;9.0+PTX"`` (the newest also as PTX,
    as torch does), or None without a visible GPU."""
    try:
        if not torch.cuda.is_available():
            return None
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    except (RuntimeError, AssertionError):
        return None
    if not caps:
        return None
    return ";".join(f"{major}.{minor}" for major, minor in caps) + "+PTX"


def _sm90a(archs: str) -> tuple[str, list[str]]:
    """``(TORCH_CUDA_ARCH_LIST, extra nvcc flags)`` with sm_90 compiled as sm_90a: the sm90
    forward's warpgroup MMA (csrc/cuda/tc90_kernels.cuh) exists only in sm_90a code, which every
    compute capability 9.0 GPU (H100, H200, GH200) runs. A "9.0+PTX" keeps its PTX as compute_90
    (sm_90a's PTX would not run on newer GPUs)."""
    out, flags = [], []
    for item in re.split(r"[;\s]+", archs.strip()):
        if item in ("9.0", "9.0+PTX"):
            out.append("9.0a")
            if item.endswith("+PTX"):
                flags.append("-gencode=arch=compute_90,code=compute_90")
        elif item:
            out.append(item)
    return ";".join(dict.fromkeys(out)), flags


def _cuda_plan() -> tuple[str | None, str]:
    """``(TORCH_CUDA_ARCH_LIST to build, why)``; None: the CPU kernels only."""
    if _flag("DILATED_ATTENTION_CPU_ONLY"):
        return None, "DILATED_ATTENTION_CPU_ONLY=1"
    if not _flag("FORCE_CUDA") and (CUDA_HOME is None or torch.version.cuda is None):
        return None, "no nvcc with a CUDA-enabled torch"
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"], "TORCH_CUDA_ARCH_LIST"
    visible = _visible_arch_list()
    if visible is not None:
        return visible, "the visible GPUs"
    if _flag("FORCE_CUDA"):
        return _default_arch_list(), "FORCE_CUDA=1, every architecture"
    return None, "no GPU visible"


def _cxx_flags() -> list[str]:
    """Host compiler flags. OpenMP (the runtime torch itself loads) makes at::parallel_for run on
    torch's intra-op threads; without it the CPU kernels run on one thread. No -ffast-math: the
    kernels keep IEEE NaN/inf semantics. No debug information (-g0, after Python's own -g): it
    costs a quarter of the compile time of the CPU kernels and most of the library's size."""
    cxx = ["-O3", "-g0", "-fno-math-errno"]
    if os.name == "posix" and os.uname().sysname == "Linux" and torch.backends.openmp.is_available():
        cxx.append("-fopenmp")
    else:
        cxx.append("-fopenmp-simd")
    return cxx


def cpu_only_message(why: str) -> str:
    """The one line a CPU-only build prints: why, and how to get the CUDA kernels."""
    how = ""
    if why == "no GPU visible":
        how = (
            f'; for CUDA kernels set TORCH_CUDA_ARCH_LIST (e.g. "9.0" for H100/H200) or FORCE_CUDA=1 '
            f"(every architecture: {_default_arch_list()}, slow)"
        )
    return f"building the CPU kernels only ({why}){how}"


def _extension():
    cxx = _cxx_flags()
    sources = [
        "csrc/dilated_attention.cpp",
        *sorted(glob.glob("csrc/cpu/*.cpp")),
        *sorted(glob.glob("csrc/views/*.cpp")),
    ]
    include = [os.path.join(HERE, "csrc")]
    archs, why = _cuda_plan()
    if archs is not None:
        if CUDA_HOME is None:
            raise RuntimeError("FORCE_CUDA=1 was given but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        root = _toolkit_root()
        if root and root != CUDA_HOME:
            cpp_extension.CUDA_HOME = root  # read by CUDAExtension and BuildExtension at build time
        built, arch_flags = _sm90a(archs)
        os.environ["TORCH_CUDA_ARCH_LIST"] = built
        print(
            f"dilated_attention: building CPU and CUDA kernels for TORCH_CUDA_ARCH_LIST={archs} ({why})"
            + (f", sm_90 as sm_90a: {built}" if built != archs else "")
        )
        # csrc/cuda: the op's CUDA half (host code in .cpp, kernels in .cu; see docs/cuda.md), and
        # csrc/cuda/tc: one file per instantiation of the tensor-core kernels, compiled in parallel.
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        nvcc += arch_flags
        nvcc += shlex.split(os.environ.get("DILATED_ATTENTION_NVCC_FLAGS", ""))  # e.g. "-Xptxas -v"
        cuda_sources = [
            *sorted(glob.glob("csrc/cuda/*.cpp")),
            *sorted(glob.glob("csrc/cuda/*.cu")),
            *sorted(glob.glob("csrc/cuda/tc/*.cu")),
            *sorted(glob.glob("csrc/views/*.cu")),
        ]
        return CUDAExtension(
            "dilated_attention._C",
            sources + cuda_sources,
            include_dirs=include,
            define_macros=[("DILATED_ATTENTION_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=check_libstdcxx.link_args(),
            py_limited_api=False,
        )
    print(f"dilated_attention: {cpu_only_message(why)}")
    return CppExtension(
        "dilated_attention._C",
        sources,
        include_dirs=include,
        extra_compile_args={"cxx": cxx},
        extra_link_args=check_libstdcxx.link_args(),
    )


class _BuildExtension(BuildExtension):
    """torch's build_ext, which also writes ``_build_info.json`` beside the extension: the torch
    and Python it was built against, so that ``dilated_attention.op.library`` can say when it runs with
    others (an extension built for another torch fails obscurely, or not at all until it crashes)."""

    def build_extensions(self) -> None:
        super().build_extensions()
        for ext in self.extensions:
            built = self.get_ext_fullpath(ext.name)
            # One libstdc++ per process: a copy linked into the extension breaks its error messages
            # (scripts/check_libstdcxx.py says how); refuse to leave such a build behind.
            found = check_libstdcxx.problems(built)
            if found:
                os.remove(built)
                raise RuntimeError(check_libstdcxx.message(built, found))
            folder = os.path.dirname(built)
            archs, why = _cuda_plan()
            info = {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": ".".join(map(str, sys.version_info[:2])),
                "cuda_arch_list": archs,
                "cuda_arch_built": _sm90a(archs)[0] if archs else None,
                "cuda_arch_reason": why,
            }
            with open(os.path.join(folder, "_build_info.json"), "w") as f:
                json.dump(info, f)

    def copy_extensions_to_source(self) -> None:
        """An in-place or editable build copies the extension into the source tree: its
        ``_build_info.json`` goes with it (``op.library`` reads it beside the extension)."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            info = os.path.join(os.path.dirname(regular_file), "_build_info.json")
            if os.path.exists(info):
                self.copy_file(info, os.path.join(os.path.dirname(inplace_file), "_build_info.json"))


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
)
