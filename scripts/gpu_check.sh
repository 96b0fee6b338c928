#!/usr/bin/env bash
# Verifies the native op's CUDA kernels on the GPU at hand, in one command, and writes every log and
# table to one folder. Without a GPU it says so and exits 0 (nothing to verify here).
#
#   scripts/gpu_check.sh [OUT_DIR] [--steps LIST] [--deadline SECONDS] [--dry-run]
#
# OUT_DIR defaults to $OUT when set, else gpu_check_out/. Steps, in order (LIST: some of them,
# comma- or space-separated; default all), each under a time budget in seconds
# (GPU_CHECK_BUDGET_<STEP> overrides it):
#
#   build     330  python setup.py build_ext --inplace for this GPU's architecture only
#                  (TORCH_CUDA_ARCH_LIST from the GPU, 9.0 on H100/H200; GPU_CHECK_ARCH overrides),
#                  nvcc flags "-Xptxas -v" (registers and spills of every kernel)  -> build.log
#   tests     300  pytest tests/test_cuda.py tests/test_ring_pieces.py -m cuda (the GPU tests of the op
#                  and of the ring's piece op; GPU_CHECK_TESTS=all runs the whole files,
#                  GPU_CHECK_SLOW=1 adds DILATED_ATTENTION_SLOW=1; in GPU_CHECK_WORKERS processes,
#                  default 4, where pytest-xdist is installed)                     -> tests.log
#   smoke     180  scripts/gpu_smoke.py: fwd/bwd against the CPU op in float64, B = 64, inputs of
#                  more than 2^31 elements                                          -> smoke.log
#   sanitize  240  compute-sanitizer memcheck, racecheck and synccheck on small forward + backward
#                  runs of both kernel families (scripts/gpu_smoke.py --cases sanitize) -> sanitize.log
#   bench     180  benchmarks/bench_cuda.py --tokens 262144                   -> bench.md/.csv/.png
#
# The steps end within GPU_CHECK_DEADLINE seconds (default 540, so that a whole run fits in 10
# minutes): a step gets at most the time left, and one that would start with less than 30 s (or
# less than its whole budget, if smaller) is reported "not run"; run it with a second command
# (e.g. --steps sanitize,bench: the in-place build stays). summary.md holds the GPU, the commit,
# each step's status and time and the key lines of every log; at most 8 files are written.
# Exit status: 0 when every step passed (or when there is no GPU), 1 when one did not, 2 on a usage
# error. --dry-run prints the commands without running them (also without a GPU).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${GPU_CHECK_PYTHON:-${PYTHON:-python3}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, not an installed copy
export PYTHONUNBUFFERED=1
ALL_STEPS=(build tests smoke sanitize bench)
declare -A BUDGET=([build]=330 [tests]=300 [smoke]=180 [sanitize]=240 [bench]=180)

usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}
die_usage() {
  echo "gpu_check: $1" >&2
  echo "usage: scripts/gpu_check.sh [OUT_DIR] [--steps LIST] [--deadline SECONDS] [--dry-run] (--help for more)" >&2
  exit 2
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

out_dir="" steps_arg="" dry=0 deadline=${GPU_CHECK_DEADLINE:-540}
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --steps) [ $# -ge 2 ] || die_usage "--steps needs a list of steps"; steps_arg=$2; shift ;;
    --steps=*) steps_arg=${1#--steps=} ;;
    --deadline) [ $# -ge 2 ] || die_usage "--deadline needs a number of seconds"; deadline=$2; shift ;;
    --deadline=*) deadline=${1#--deadline=} ;;
    -*) die_usage "unknown option '$1'" ;;
    *) [ -z "$out_dir" ] || die_usage "one output folder only, got '$out_dir' and '$1'"; out_dir=$1 ;;
  esac
  shift
done
is_uint "$deadline" || die_usage "the deadline must be a whole number of seconds, got '$deadline'"
steps=()
if [ -n "$steps_arg" ]; then
  for s in ${steps_arg//,/ }; do
    [[ -n "${BUDGET[$s]+x}" ]] || die_usage "unknown step '$s'; the steps are: ${ALL_STEPS[*]}"
    steps+=("$s")
  done
  [ ${#steps[@]} -gt 0 ] || die_usage "--steps names no step"
else
  steps=("${ALL_STEPS[@]}")
fi
for s in "${ALL_STEPS[@]}"; do
  var="GPU_CHECK_BUDGET_${s^^}"
  if [ -n "${!var:-}" ]; then
    { is_uint "${!var}" && [ "${!var}" -ge 1 ]; } || die_usage "$var must be a whole number of seconds >= 1, got '${!var}'"
    BUDGET[$s]=${!var}
  fi
done
out_dir=${out_dir:-${OUT:-gpu_check_out}}
mkdir -p "$out_dir" || die_usage "cannot create the output folder '$out_dir'"
out_dir=$(cd "$out_dir" && pwd)
summary="$out_dir/summary.md"

# The GPU, or why there is none. GPU_CHECK_ASSUME_GPU=1 skips the probe (for testing this script).
if [ "${GPU_CHECK_ASSUME_GPU:-0}" = "1" ]; then
  gpu="${GPU_CHECK_ARCH:-9.0}|assumed GPU|-|-"
else
  gpu=$("$PYTHON" -c '
import torch
if torch.cuda.is_available() and torch.cuda.device_count() > 0:
    major, minor = torch.cuda.get_device_capability()
    print(f"{major}.{minor}|{torch.cuda.get_device_name()}|{torch.__version__}|{torch.version.cuda}")
else:
    print(f"none|torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA GPU")
' 2>&1 | tail -1)
fi
IFS='|' read -r gpu_cap gpu_name torch_version cuda_version <<<"$gpu"
if ! [[ "$gpu_cap" =~ ^[0-9]+\.[0-9]+$ ]]; then
  if [ "$dry" = 1 ]; then
    gpu_cap=${GPU_CHECK_ARCH:-9.0} gpu_name="(no GPU: dry run)"
  else
    msg="gpu_check: no CUDA GPU here (${gpu_name:-$gpu}); nothing to verify, skipping. Run this script on a machine with an NVIDIA GPU (H100/H200)."
    echo "$msg"
    printf '# GPU check: skipped\n\n%s\n' "$msg" >"$summary"
    exit 0
  fi
fi
arch=${GPU_CHECK_ARCH:-$gpu_cap}

# Tools: nvcc and compute-sanitizer from PATH, CUDA_HOME or /usr/local/cuda.
for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin; do
  if [ -d "$d" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x "$d/nvcc" ]; then PATH="$PATH:$d"; fi
done
sanitizer=$(command -v compute-sanitizer 2>/dev/null || true)
for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
  if [ -z "$sanitizer" ] && [ -x "$d/compute-sanitizer" ]; then sanitizer="$d/compute-sanitizer"; fi
done

tests_sel=(-m cuda)
[ "${GPU_CHECK_TESTS:-gpu}" = "all" ] && tests_sel=()
# pytest-xdist, where installed, runs the tests in GPU_CHECK_WORKERS processes (default 4; 1: none).
workers=${GPU_CHECK_WORKERS:-4}
is_uint "$workers" && [ "$workers" -ge 1 ] || die_usage "GPU_CHECK_WORKERS must be a whole number >= 1, got '$workers'"
if [ "$workers" -gt 1 ] && "$PYTHON" -c "import xdist" >/dev/null 2>&1; then tests_sel+=(-n "$workers"); fi
slow=0
[ "${GPU_CHECK_SLOW:-0}" = "1" ] && slow=1
jobs=$(nproc 2>/dev/null || echo 4)

# The command of each step (an array per step; sanitize runs it under each tool).
build_cmd=(env -u DILATED_ATTENTION_CPU_ONLY FORCE_CUDA=1 "TORCH_CUDA_ARCH_LIST=$arch"
  "DILATED_ATTENTION_NVCC_FLAGS=-Xptxas -v" "MAX_JOBS=$jobs" "$PYTHON" setup.py build_ext --inplace)
tests_cmd=(env "DILATED_ATTENTION_SLOW=$slow" "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider tests/test_cuda.py tests/test_ring_pieces.py "${tests_sel[@]}")
smoke_cmd=("$PYTHON" scripts/gpu_smoke.py --cases small large)
sanitize_cmd=("$PYTHON" scripts/gpu_smoke.py --cases sanitize)
bench_cmd=("$PYTHON" benchmarks/bench_cuda.py --tokens 262144 --out "$out_dir/bench")
SANITIZER_TOOLS=(memcheck racecheck synccheck)

show() { printf '%q ' "$@"; }
if [ "$dry" = 1 ]; then
  echo "gpu_check (dry run): GPU ${gpu_name} (sm_${arch/./}), output folder $out_dir, deadline ${deadline} s"
  for s in "${steps[@]}"; do
    case $s in
      build) echo "build (${BUDGET[build]} s): $(show "${build_cmd[@]}")> build.log" ;;
      tests) echo "tests (${BUDGET[tests]} s): $(show "${tests_cmd[@]}")> tests.log" ;;
      smoke) echo "smoke (${BUDGET[smoke]} s): $(show "${smoke_cmd[@]}")> smoke.log" ;;
      sanitize)
        for t in "${SANITIZER_TOOLS[@]}"; do
          echo "sanitize (${BUDGET[sanitize]} s for all three): ${sanitizer:-compute-sanitizer} --tool $t --error-exitcode 3 --print-limit 30 $(show "${sanitize_cmd[@]}")>> sanitize.log"
        done ;;
      bench) echo "bench (${BUDGET[bench]} s): $(show "${bench_cmd[@]}")> bench.md, bench.csv, bench.png" ;;
    esac
  done
  exit 0
fi

start_all=$(date +%s)
left() { echo $((deadline - ($(date +%s) - start_all))); }
# Runs "$@" with a time limit, output to a log; prints the exit status (124: out of time).
run_logged() {
  local limit=$1 log=$2
  shift 2
  timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  echo $?
}
# Keeps a log under the 16 MiB a returned file may have: its first and last 6 MiB.
cap_log() {
  local f=$1
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt $((15 * 1024 * 1024)) ]; then
    { head -c $((6 * 1024 * 1024)) "$f"; printf '\n[... cut by gpu_check ...]\n'; tail -c $((6 * 1024 * 1024)) "$f"; } >"$f.cut"
    mv "$f.cut" "$f"
  fi
}
has_cuda_kernels() {
  "$PYTHON" -c 'import sys, dilated_attention._ops as o; sys.exit(0 if o.has_kernel("cuda") else 1)' >/dev/null 2>&1
}

declare -A STATUS SECS
built_ok=1
for s in "${steps[@]}"; do
  remaining=$(left)
  budget=${BUDGET[$s]}
  floor=30  # a step does not start with less time than this (or than its whole budget)
  [ "$budget" -lt "$floor" ] && floor=$budget
  [ "$remaining" -lt "$budget" ] && budget=$remaining
  if [ "$budget" -lt "$floor" ] || [ "$budget" -lt 1 ]; then
    STATUS[$s]="not run: deadline (${remaining} s left of ${deadline})"
    SECS[$s]=0
    continue
  fi
  if [ "$s" != build ] && { [ "$built_ok" = 0 ] || ! has_cuda_kernels; }; then
    STATUS[$s]="not run: the extension has no CUDA kernels (the build step failed or was not run)"
    SECS[$s]=0
    continue
  fi
  echo "gpu_check: $s (budget ${budget} s) ..."
  t0=$(date +%s)
  case $s in
    build)
      log="$out_dir/build.log"
      : >"$log"
      rc=$(run_logged "$budget" "$log" "${build_cmd[@]}")
      if [ "$rc" = 0 ] && ! has_cuda_kernels; then
        echo "gpu_check: the build finished but dilated_attention has no CUDA kernels" >>"$log"
        rc=1
      fi
      [ "$rc" = 0 ] || built_ok=0
      ;;
    tests | smoke | bench)
      log="$out_dir/$s.log"  # bench.log goes into summary.md: the benchmark writes bench.md itself
      : >"$log"
      case $s in
        tests) rc=$(run_logged "$budget" "$log" "${tests_cmd[@]}") ;;
        smoke) rc=$(run_logged "$budget" "$log" "${smoke_cmd[@]}") ;;
        bench) rc=$(run_logged "$budget" "$log" "${bench_cmd[@]}") ;;
      esac
      ;;
    sanitize)
      log="$out_dir/sanitize.log"
      : >"$log"
      if [ -z "$sanitizer" ]; then
        echo "gpu_check: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)" >>"$log"
        rc=unavailable
      else
        rc=0
        n=${#SANITIZER_TOOLS[@]}
        for t in "${SANITIZER_TOOLS[@]}"; do
          each=$(((budget - ($(date +%s) - t0)) / n))  # the step's time left, shared by the tools left
          n=$((n - 1))
          if [ "$each" -lt 5 ]; then
            printf '\n===== compute-sanitizer --tool %s: not run, out of time\n' "$t" >>"$log"
            rc=124
            continue
          fi
          printf '\n===== compute-sanitizer --tool %s (limit %s s) =====\n' "$t" "$each" >>"$log"
          extra=()
          [ "$t" = memcheck ] && extra=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)  # each tensor its own allocation
          r=$(run_logged "$each" "$log" "${extra[@]}" "$sanitizer" --tool "$t" --error-exitcode 3 --print-limit 30 "${sanitize_cmd[@]}")
          echo "===== $t: exit status $r" >>"$log"
          if [ "$r" != 0 ]; then
            if grep -qiE "device not supported|not supported on this" "$log"; then rc=unavailable; else rc=$r; fi
          fi
        done
      fi
      ;;
  esac
  SECS[$s]=$(($(date +%s) - t0))
  cap_log "$log"
  case $rc in
    0) STATUS[$s]=pass ;;
    124 | 137) STATUS[$s]="FAIL: out of time (${budget} s)" ;;
    unavailable) STATUS[$s]="unavailable: compute-sanitizer cannot run here (see sanitize.log)" ;;
    *) STATUS[$s]="FAIL (exit status $rc)" ;;
  esac
  echo "gpu_check: $s: ${STATUS[$s]} (${SECS[$s]} s)"
done
# summary.md: what ran where, each step's status, and the lines that matter from each log.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no git)")
dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | head -1)
{
  echo "# GPU check of the native CUDA kernels"
  echo
  echo "- GPU: ${gpu_name} (sm_${arch/./}); torch ${torch_version}, CUDA ${cuda_version}"
  echo "- commit: ${commit}${dirty:+ (with uncommitted changes)}; $(date -u '+%Y-%m-%d %H:%M UTC')"
  command -v nvidia-smi >/dev/null 2>&1 &&
    echo "- nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| step | status | seconds |"
  echo "| --- | --- | --- |"
  for s in "${steps[@]}"; do echo "| $s | ${STATUS[$s]} | ${SECS[$s]} |"; done
  if [ -f "$out_dir/build.log" ]; then
    echo
    echo "## ptxas (registers, spills, shared memory per kernel)"
    echo '```'
    grep -E "Compiling entry function|Used [0-9]+ registers|bytes spill" "$out_dir/build.log" |
      sed -e 's/^ptxas info *: //' | head -400
    echo '```'
  fi
  for f in tests smoke; do
    [ -f "$out_dir/$f.log" ] || continue
    echo
    echo "## $f"
    echo '```'
    if [ "$f" = tests ]; then
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$out_dir/$f.log" | tail -60
    else
      grep -E "^(PASS|FAIL|SKIP|  )|gpu_smoke|dense bf16|GPU:" "$out_dir/$f.log" | tail -60
    fi
    echo '```'
  done
  if [ -f "$out_dir/sanitize.log" ]; then
    echo
    echo "## compute-sanitizer"
    echo '```'
    grep -E "^=====|ERROR SUMMARY|not found|not supported" "$out_dir/sanitize.log" | tail -40
    echo '```'
  fi
  if [ -f "$out_dir/bench.log" ]; then
    echo
    echo "## benchmark output (the table: bench.md, bench.csv, bench.png)"
    echo '```'
    grep -v "configurations:" "$out_dir/bench.log" | tail -80  # without tqdm's progress lines
    echo '```'
  fi
} >"$summary"
rm -f "$out_dir/bench.log"  # kept in summary.md: at most 8 files in the folder
echo "gpu_check: wrote $summary"
for s in "${steps[@]}"; do
  [ "${STATUS[$s]}" = pass ] || exit 1
done
exit 0
