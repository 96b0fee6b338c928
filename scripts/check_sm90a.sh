#!/usr/bin/env bash
# Compiles the sm90 (wgmma) kernels for sm_90a with ptxas's report, without a GPU: every
# translation unit that instantiates them (csrc/cuda/tc/*90_*.cu, csrc/cuda/tc90_dispatch.cu), so
# that `make cuda-check` assembles their inline PTX (scripts/check_cuda_build.sh builds sm_75 and
# sm_80, where this code compiles to nothing). Prints the registers of each kernel and fails, by
# scripts/sm90_registers.py, where a kernel does not start with the 168 registers of a 384-thread
# block (setmaxnreg then gives the producer warpgroup kTc90ProducerRegs and the consumers
# kTc90ConsumerRegs, tc90_pipe.cuh: with fewer the consumers would wait forever), spills
# registers to local memory (none does: docs/cuda.md), or
# draws ptxas's C7519/C7517 notes (it inserted a wgmma fence or wait that the code should have) or
# its C7514/C7520 notes (it serialises the wgmmas); and on a compiler error.
#
#   scripts/check_sm90a.sh          # a few minutes on 2 cores (MAX_JOBS files at a time)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
JOBS=${MAX_JOBS:-2}
[ -x "$NVCC" ] || { echo "check_sm90a: nvcc not found (put it on PATH or set CUDA_HOME)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/da_sm90a.XXXXXX")
trap 'rm -rf "$work"' EXIT
mapfile -t inc < <("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths
print("\n".join(include_paths()))' 2>/dev/null)
[ ${#inc[@]} -gt 0 ] || { echo "check_sm90a: cannot import torch with $PYTHON" >&2; exit 1; }
flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
  -Xptxas -v -Icsrc)
for d in "${inc[@]}"; do flags+=(-isystem "$d"); done

sources=(csrc/cuda/tc90_dispatch.cu $(ls csrc/cuda/tc/*90_*.cu))
echo "check_sm90a: $("$NVCC" --version | tail -1), ${#sources[@]} files for sm_90a ($JOBS at a time)"
start=$(date +%s)
pids=()
i=0
for src in "${sources[@]}"; do
  "$NVCC" "${flags[@]}" -c "$src" -o "$work/$i.o" >"$work/$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
  if [ ${#pids[@]} -ge "$JOBS" ]; then wait "${pids[0]}" || true; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || true; done

failed=0
i=0
for src in "${sources[@]}"; do
  log="$work/$i.log"
  if [ ! -s "$work/$i.o" ] || grep -q "error" "$log"; then
    echo "  $src: does not compile for sm_90a:" >&2
    grep -E "error" "$log" | head -10 >&2
    failed=1
  fi
  i=$((i + 1))
done
# Registers (168 at launch for setmaxnreg's split), spills and ptxas's wgmma notes, per kernel.
"$PYTHON" scripts/sm90_registers.py "$work"/*.log || failed=1
echo "check_sm90a: ${#sources[@]} files in $(( $(date +%s) - start )) s"
if [ "$failed" != 0 ]; then
  echo "check_sm90a: FAILED" >&2
  exit 1
fi
echo "check_sm90a: the sm90 kernels compile for sm_90a without spills"
