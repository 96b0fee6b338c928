#!/usr/bin/env bash
# Checks that the C++ and CUDA sources are C++17: torch 2.11 (the CUDA images' torch) builds
# extensions with -std=c++17, while newer torch builds them as C++20, so a C++20 construct in
# csrc/ would compile here and fail there. No GPU needed.
#
#   scripts/check_cxx17.sh
#
# * Every .cpp of csrc/ (with its headers) through the host compiler with -std=c++17 -Wpedantic
#   -fsyntax-only, the CUDA half with DILATED_ATTENTION_WITH_CUDA. Newer torch headers are
#   themselves C++20 and fail to parse as C++17; only diagnostics located in csrc/ count: an error
#   there, or a C++20-extension warning (designated initializers and the like).
# * Every .cu file through nvcc -std=c++17 (host and device front ends, -cuda) for compute_80,
#   the tensor-core path (scripts/check_simt_sm60.sh compiles compute_75 with -std=c++17 too).
#   nvcc's front end takes a few C++20 forms in C++17 mode silently (designated initializers), so
#   this part catches C++20 language and library features that C++17 lacks (concepts, <=>,
#   std::span...), not those.
#
# Before the sources, a planted C++20 file must be refused, so that the check is known to be able
# to fail. Exit status 1 on any failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
CXX=${CXX:-c++}
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
JOBS=${MAX_JOBS:-2}

work=$(mktemp -d "${TMPDIR:-/tmp}/da_cxx17.XXXXXX")
trap 'rm -rf "$work"' EXIT

mapfile -t torch_inc < <("$PYTHON" -c 'import sysconfig
from torch.utils.cpp_extension import include_paths
print("\n".join(include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null)
[ ${#torch_inc[@]} -gt 0 ] || { echo "check_cxx17: cannot import torch with $PYTHON" >&2; exit 1; }
cuda_inc=()
if [ -x "$NVCC" ]; then
  top=$("$NVCC" -v --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  for d in "$top/include" "$top/targets/x86_64-linux/include" /usr/local/cuda/include; do
    [ -f "$d/cuda_runtime_api.h" ] && { cuda_inc=(-isystem "$d"); break; }
  done
fi
host_flags=(-std=c++17 -Wpedantic -fsyntax-only -fopenmp -Icsrc)
for d in "${torch_inc[@]}"; do host_flags+=(-isystem "$d"); done

# $1 source, $2 log, $3 the folder whose diagnostics count; prints them, fails when there are any.
host_check() {
  local src=$1 log=$2 mine=$3 extra=()
  case "$src" in */cuda/* | */views/*) extra=(-DDILATED_ATTENTION_WITH_CUDA "${cuda_inc[@]}") ;; esac
  [ "$src" = csrc/dilated_attention.cpp ] && extra=(-DDILATED_ATTENTION_WITH_CUDA "${cuda_inc[@]}")
  "$CXX" "${host_flags[@]}" "${extra[@]}" "$src" >"$log" 2>&1 || true
  if grep -E "^${mine}[^:]*:[0-9]+:[0-9]+: (error|warning|fatal error):" "$log" | grep -E "error|c\+\+20|C\+\+20" >"$log.mine"; then
    echo "  $src: not C++17:" >&2
    head -20 "$log.mine" >&2
    return 1
  fi
}

cat >"$work/planted.cpp" <<'EOF'
#include <ATen/ATen.h>
struct Planted { int a; int b; };
int planted(const at::Tensor& t) { Planted p{.a = 1, .b = 2}; return p.a + static_cast<int>(t.dim()); }
EOF
if host_check "$work/planted.cpp" "$work/planted.log" "$work/" 2>/dev/null; then
  echo "check_cxx17: a planted C++20 designated initializer passed the host check: this check cannot fail" >&2
  exit 1
fi

echo "check_cxx17: $("$CXX" --version | head -1), -std=c++17, sources of csrc/ ($JOBS at a time)"
failed=0
pids=()
i=0
for src in $(git ls-files 'csrc/*.cpp'); do
  host_check "$src" "$work/host_$i.log" "csrc/" &
  pids+=($!)
  i=$((i + 1))
  if [ ${#pids[@]} -ge "$JOBS" ]; then wait "${pids[0]}" || failed=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
echo "check_cxx17: $i C++ sources checked as C++17"

if [ ! -x "$NVCC" ]; then
  echo "check_cxx17: nvcc not found: the .cu files are not checked (put it on PATH or set CUDA_HOME)" >&2
  exit 1
fi
nv_flags=(-std=c++17 -arch=compute_80 --expt-relaxed-constexpr --use_fast_math -Xcicc -O0 -Icsrc -DDILATED_ATTENTION_WITH_CUDA)
for d in "${torch_inc[@]}"; do nv_flags+=(-I"$d"); done
cat >"$work/planted.cu" <<'EOF'
template <class T> concept Small = sizeof(T) < 8;
__global__ void planted(int* x) { if constexpr (Small<int>) x[0] = 1; }
EOF
if "$NVCC" "${nv_flags[@]}" -cuda "$work/planted.cu" -o "$work/planted.ii" >/dev/null 2>&1; then
  echo "check_cxx17: nvcc accepted a planted C++20 concept with -std=c++17: this check cannot fail" >&2
  exit 1
fi
n=0
for src in csrc/cuda/*.cu csrc/cuda/tc/*.cu csrc/views/*.cu; do
  # A .cu file with host code (torch's headers, which this torch builds as C++20) is compiled by
  # check_cuda_build.sh with the flags of the build itself; here only the kernel-only files.
  if grep -qE '^#include <(ATen|torch|c10/cuda)/' "$src"; then
    echo "  $src: host code with torch's headers, compiled by check_cuda_build.sh (skipped here)"
    continue
  fi
  if ! "$NVCC" "${nv_flags[@]}" -cuda "$src" -o "$work/$(basename "$src").ii" >"$work/nvcc.log" 2>&1 ||
    grep -qiE "c\+\+20|designated initializer" "$work/nvcc.log"; then
    echo "  $src: nvcc -std=c++17 refused it:" >&2
    head -20 "$work/nvcc.log" >&2
    failed=1
  fi
  n=$((n + 1))
done
echo "check_cxx17: $n CUDA sources compiled by $("$NVCC" --version | sed -n 's/.*\(release [0-9.]*\),.*/\1/p') with -std=c++17 (compute_80)"
[ "$failed" = 0 ] || { echo "check_cxx17: FAILED" >&2; exit 1; }
echo "check_cxx17: every source of csrc/ is C++17"
