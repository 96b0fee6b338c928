#!/usr/bin/env bash
# Compiles and links the extension with its CUDA kernels in a scratch directory, then loads the
# result and checks that dilated_attention::fwd, bwd, varlen_fwd, varlen_bwd, piece_fwd, piece_bwd,
# decode_step, views_fwd, views_bwd, views_varlen_fwd and views_varlen_bwd have CPU and CUDA
# kernels. Needs nvcc and a CUDA-enabled torch, no GPU. The installed extension
# (dilated_attention/_C*.so) is left alone.
#
#   scripts/check_cuda_build.sh                                   # sm_75 and sm_80 (a few minutes on 2 cores)
#   DILATED_ATTENTION_CHECK_ARCHS="7.5;8.0;8.6;8.9;9.0" scripts/check_cuda_build.sh
#   DILATED_ATTENTION_CHECK_ARCHS=default scripts/check_cuda_build.sh   # setup.py's full default list
#   DILATED_ATTENTION_CHECK_PTXAS=1 scripts/check_cuda_build.sh   # also print registers/spills per kernel
#
# sm_75 builds the SIMT kernels and the tensor-core kernels' pre-sm80 stubs, sm_80 the
# tensor-core kernels themselves: together they compile every line of csrc/cuda. Any compiler,
# linker or load error fails the script (exit status 1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
archs=${DILATED_ATTENTION_CHECK_ARCHS:-"7.5;8.0"}

if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ]; then
  echo "check_cuda_build: nvcc not found (put it on PATH or set CUDA_HOME)" >&2
  exit 1
fi
if [ "$("$PYTHON" -c 'import torch; print(torch.version.cuda is not None)')" != "True" ]; then
  echo "check_cuda_build: this torch ($("$PYTHON" -c 'import torch; print(torch.__version__)')) is not CUDA-enabled;" \
       "the CUDA kernels can compile but not link against it" >&2
  exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/da_cuda_check.XXXXXX")
trap 'rm -rf "$work"' EXIT

export FORCE_CUDA=1
unset DILATED_ATTENTION_CPU_ONLY
if [ "$archs" != "default" ]; then
  export TORCH_CUDA_ARCH_LIST="$archs"
else
  unset TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS=${MAX_JOBS:-2}
if [ "${DILATED_ATTENTION_CHECK_PTXAS:-0}" = "1" ]; then
  export DILATED_ATTENTION_NVCC_FLAGS="-Xptxas -v"
fi

echo "check_cuda_build: compiling csrc/ with CUDA for TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-<setup.py default>} in $work"
start=$(date +%s)
"$PYTHON" setup.py -q build_ext --build-temp "$work/tmp" --build-lib "$work/lib" > "$work/build.log" 2>&1 || {
  grep -E "error|Error" "$work/build.log" | head -40 >&2 || true
  echo "check_cuda_build: the build failed; the last lines of its log:" >&2
  tail -30 "$work/build.log" >&2
  exit 1
}
if [ "${DILATED_ATTENTION_CHECK_PTXAS:-0}" = "1" ]; then
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$work/build.log" | sed -e 's/ptxas info *: //' || true
fi
echo "check_cuda_build: built in $(( $(date +%s) - start )) s"

# One libstdc++ per process (scripts/check_libstdcxx.py): setup.py refuses a build that carries
# its own copy; this says so again for the CUDA-linked library.
"$PYTHON" scripts/check_libstdcxx.py "$work"/lib/dilated_attention/_C*.so

"$PYTHON" - "$work/lib" <<'EOF'
import glob
import sys

import torch

libs = glob.glob(f"{sys.argv[1]}/dilated_attention/_C*.so")
assert len(libs) == 1, f"expected one built library, found {libs}"
torch.ops.load_library(libs[0])
ops = (
    "fwd", "bwd", "varlen_fwd", "varlen_bwd", "piece_fwd", "piece_bwd", "decode_step",
    "views_fwd", "views_bwd", "views_varlen_fwd", "views_varlen_bwd",
)
missing = [f"{op} on {key}" for op in ops for key in ("CPU", "CUDA")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dilated_attention::{op}", key)]
if missing:
    sys.exit(f"check_cuda_build: the built library lacks kernels for {', '.join(missing)}")
print(f"check_cuda_build: {libs[0].rsplit('/', 1)[-1]} loads; dilated_attention::{', ::'.join(ops)} have CPU and CUDA kernels")
EOF
