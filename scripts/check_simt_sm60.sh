#!/usr/bin/env bash
# Checks that the CUDA sources assemble for Pascal (sm_60, sm_61) and Volta (sm_70), the GPUs that
# only a CUDA 12 toolkit can still target (CUDA 13 dropped everything below sm_75). No GPU needed.
#
#   scripts/check_simt_sm60.sh
#
# With a CUDA 12 nvcc the .cu files are compiled to PTX for compute_60 and assembled for sm_60, sm_61
# and sm_70 as a real build would. With CUDA 13's nvcc (which cannot emit compute_60) they are compiled
# to PTX for compute_75, the oldest target it has, the PTX is relabelled .target sm_60/61/70 and
# assembled by a CUDA 12 ptxas: any instruction that Pascal lacks (shuffles and votes are fine;
# mma, ldmatrix, cp.async, nanosleep are not on sm_60) fails there. What this cannot see: code that the
# CUDA headers select by __CUDA_ARCH__ is their sm_75 variant, not the sm_60/sm_70 one.
#
# The CUDA 12 ptxas comes from the nvidia-cuda-nvcc-cu12 wheel (PyPI), downloaded once with pip
# (not installed) into ${XDG_CACHE_HOME:-~/.cache}/dilated_attention/; DILATED_ATTENTION_PTXAS12
# names another ptxas of CUDA 12. Before the sources, a planted sm_70 instruction must be refused,
# so that the check is known to be able to fail. Exit status 1 on any failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
WHEEL_VERSION=12.9.86
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
[ -x "$NVCC" ] || { echo "check_simt_sm60: nvcc not found (put it on PATH or set CUDA_HOME)" >&2; exit 1; }
major=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')

work=$(mktemp -d "${TMPDIR:-/tmp}/da_sm60.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [ "$major" -le 12 ]; then
  ptxas="$(dirname "$NVCC")/ptxas"
  virtual=compute_60
else
  virtual=compute_75
  ptxas=${DILATED_ATTENTION_PTXAS12:-}
  if [ -z "$ptxas" ]; then
    cache="${XDG_CACHE_HOME:-$HOME/.cache}/dilated_attention/nvcc-cu12-$WHEEL_VERSION"
    ptxas="$cache/nvidia/cuda_nvcc/bin/ptxas"
    if [ ! -x "$ptxas" ]; then
      echo "check_simt_sm60: fetching a CUDA 12 ptxas (nvidia-cuda-nvcc-cu12==$WHEEL_VERSION, about 40 MB) into $cache"
      mkdir -p "$cache"
      "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        --platform manylinux_2_12_x86_64 -d "$work/wheel" "nvidia-cuda-nvcc-cu12==$WHEEL_VERSION" || {
        echo "check_simt_sm60: could not download nvidia-cuda-nvcc-cu12 (no network?); set DILATED_ATTENTION_PTXAS12" >&2
        exit 1
      }
      "$PYTHON" -m zipfile -e "$work"/wheel/*.whl "$cache"
      chmod +x "$ptxas"
    fi
  fi
fi
ptxas_version=$("$ptxas" --version 2>&1 | sed -n 's/.*\(release [0-9.]*\),.*/\1/p')
case "$ptxas_version" in
  "release 12."*) ;;
  *) echo "check_simt_sm60: $ptxas is not a CUDA 12 ptxas (${ptxas_version:-no version})" >&2; exit 1 ;;
esac

includes=$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths()))' 2>/dev/null)
flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -Icsrc $includes -DDILATED_ATTENTION_WITH_CUDA)

TARGETS=(60 61 70)
targets_txt=$(printf 'sm_%s ' "${TARGETS[@]}")
# PTX of one .cu file for the old targets: $1 source, $2 output stem.
to_ptx() {
  "$NVCC" "${flags[@]}" -arch="$virtual" --ptx "$1" -o "$2.ptx"
  for sm in "${TARGETS[@]}"; do
    sed -e 's/^\.version 9\.[0-9]*$/.version 8.8/' -e "s/^\.target sm_[0-9a-z]*/.target sm_$sm/" "$2.ptx" >"$2.sm_$sm.ptx"
  done
}
assemble() {  # $1 stem, then the targets; fails when ptxas refuses one of them
  local stem=$1 sm rc=0
  shift
  for sm in "$@"; do
    "$ptxas" -arch="sm_$sm" "$stem.sm_$sm.ptx" -o "$stem.sm_$sm.cubin" 2>"$stem.sm_$sm.err" || rc=1
  done
  return $rc
}

# The check must be able to fail: an sm_70 instruction (nanosleep) is refused for sm_60.
cat >"$work/planted.cu" <<'EOF'
__global__ void planted(int* x) { __nanosleep(100); x[threadIdx.x] = 1; }
EOF
to_ptx "$work/planted.cu" "$work/planted"
if assemble "$work/planted" 60; then
  echo "check_simt_sm60: the planted sm_70 instruction was accepted for sm_60: this check cannot fail" >&2
  exit 1
fi

echo "check_simt_sm60: nvcc $major ($virtual PTX), ptxas $ptxas_version, targets ${targets_txt% }"
failed=0
for src in csrc/cuda/*.cu csrc/cuda/tc/*.cu csrc/views/*.cu; do
  # A .cu file with host code (torch's headers, which this torch builds as C++20) is compiled by
  # check_cuda_build.sh with the flags of the build itself; here only the kernel-only files.
  if grep -qE '^#include <(ATen|torch|c10/cuda)/' "$src"; then
    echo "  $src: host code with torch's headers, compiled by check_cuda_build.sh (skipped here)"
    continue
  fi
  stem="$work/$(basename "$src" .cu)"
  to_ptx "$src" "$stem"
  if assemble "$stem" "${TARGETS[@]}"; then
    kernels=$(grep -c "^\.visible \.entry\|^\.entry" "$stem.ptx" || true)
    echo "  $src: $kernels kernels assemble"
  else
    failed=1
    echo "  $src: ptxas refused it:" >&2
    cat "$stem".sm_6*.err | head -20 >&2
  fi
done
[ "$failed" = 0 ] || { echo "check_simt_sm60: FAILED" >&2; exit 1; }
echo "check_simt_sm60: every CUDA source assembles for ${targets_txt% }"
