#!/usr/bin/env bash
# Verifies the native op's CUDA kernels on the GPU at hand and writes every log and table to one
# folder. Two commands, each under 8 minutes on an H100 (a device command may run 10), and a third
# for the profile, which fits after a build but not after the sanitizers:
#
#   scripts/gpu_check.sh tests    [OUT_DIR]   # build, tests, (backtrace,) smoke
#   scripts/gpu_check.sh sanitize [OUT_DIR]   # (build if needed), memcheck, racecheck, synccheck, bench
#   scripts/gpu_check.sh profile  [OUT_DIR]   # (build if needed), Nsight Compute profile
#   scripts/gpu_check.sh all      [OUT_DIR]   # every step (default; what does not fit is "not run")
#   options: [--steps LIST] [--deadline SECONDS] [--dry-run]
#
# OUT_DIR defaults to $OUT when set, else gpu_check_out/ (a folder named like a phase: ./tests).
# The first lines printed (and summary.md) say what the machine has: Python, setuptools (>= 77 for
# pyproject.toml's license field), ninja, nvcc, torch/CUDA/cuDNN, the GPU, the driver,
# compute-sanitizer, pytest-xdist (scripts/gpu.py env). When a build is needed and cannot run here,
# the script stops there with one line per missing piece (exit status 3). Without a GPU it says
# so and exits 0 (nothing to verify here).
#
# Steps (LIST: some of them, comma- or space-separated; "sanitize" = the three sanitizer tools),
# each under its own time budget in seconds (GPU_CHECK_BUDGET_<STEP> overrides it); a step that
# runs past its budget is stopped and reported, and the next steps run:
#
#   build      200  setup.py build_ext --inplace for the visible GPU's architecture only
#                   (TORCH_CUDA_ARCH_LIST from the GPU, 9.0 on H100/H200; GPU_CHECK_ARCH overrides),
#                   MAX_JOBS = the CPUs, nvcc "-Xptxas -v" (registers and spills per kernel).
#                   Skipped when the in-place build is up to date (same sources, setup.py and
#                   architecture; GPU_CHECK_REBUILD=1 forces it)                     -> build.log
#   tests      280  pytest tests/test_{decode_cuda,backends_views,cuda,ring_pieces}.py -m cuda (GPU_CHECK_TESTS=all:
#                   the whole files; GPU_CHECK_SLOW=1 adds DILATED_ATTENTION_SLOW=1), in
#                   GPU_CHECK_WORKERS processes (default: the CPUs but two, at most 14) where
#                   pytest-xdist is installed                                           -> tests.log
#                   pytest -v: one line per test as it ends (PASSED/FAILED/ERROR/SKIPPED; the test
#                   of a crashed xdist worker FAILED after "node down"), so that a run cut by its
#                   budget still names every result so far; --tb=short, --durations=25. summary.md
#                   lists the failed, errored and crashed tests, the counts (counted from the
#                   per-test lines, with the tests still running, when pytest was cut before its
#                   own), the test frame of each "Fatal Python error" (faulthandler) and the
#                   slowest tests (scripts/gpu.py testlog reads the log)
#   backtrace   60  only after crashes in tests.log ("not needed" otherwise): each crashed test
#                   (at most 3: the node id that pytest-xdist names, else file::function from the
#                   faulthandler dump) alone, pytest -x -p no:xdist under cuda-gdb, else gdb
#                   (GPU_CHECK_DEBUGGER: another, or none), "-batch -ex run -ex bt -ex quit": the
#                   native stack at the fatal signal; the first gets up to 40 s. Without a debugger
#                   it says so ("unavailable")       -> appended to tests.log, frames #0-#30 in summary.md
#   smoke       90  scripts/gpu.py smoke: the refused calls raise their errors on the CPU and the
#                   GPU, each in a process of its own (a worker that dies there says which call);
#                   fwd/bwd against the CPU op in float64, B = 64, inputs of more than 2^31
#                   elements, last the sm90 (wgmma) kernels (that they ran, on sm90)     -> smoke.log
#   memcheck    90  compute-sanitizer --tool memcheck  \
#   racecheck  120  compute-sanitizer --tool racecheck  } on scripts/gpu.py smoke --cases sanitize
#   synccheck   60  compute-sanitizer --tool synccheck /  (small fwd+bwd of both kernel families)
#                                                                                      -> sanitize.log
#   bench      150  benchmarks/bench_cuda.py (bf16, 256K and 1M tokens, H=16, D=64/128: native,
#                   sdpa, gather+flash, dense cuDNN, matmul), its own --budget 30 s under the
#                   step's; GPU_CHECK_BENCH_ARGS adds arguments ("--tokens 262144") -> bench.md/.csv/.png
#   profile     90  Nsight Compute (ncu --clock-control none: speed of light, occupancy, launch,
#                   warp states, memory and compute workload) on the tensor-core forward, dq and
#                   dk/dv kernels of scripts/gpu.py profile, sm80 and sm90 (wgmma) families (bf16,
#                   N = 256K, H = 16, D = 128, LongNet branches), one launch each; ncu from PATH, $CUDA_HOME/bin,
#                   /usr/local/cuda/bin or /opt/nvidia/nsight-compute/*/    -> summary.md (key lines)
#
# The steps end within GPU_CHECK_DEADLINE seconds (default 470 for a phase, 540 for all): a step
# gets at most the time left, and one that would start with less than 30 s (or less than its
# budget, if smaller) is reported "not run". summary.md holds the machine, the GPU, the commit,
# each step's status and time and the key lines of every log, and, when every step passed, the
# entry of dilated_attention/gpu_records.json ("verified") that records the pass for this GPU's
# compute capability (auto picks native only on recorded capabilities); at most 8 files are written.
# Exit status: 0 when every step passed (or was "not needed"; or when there is no GPU), 1 when one
# did not, 2 on a usage error, 3 when the build cannot run here. --dry-run prints the commands
# without running them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${GPU_CHECK_PYTHON:-${PYTHON:-python3}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, not an installed copy
export PYTHONUNBUFFERED=1
ALL_STEPS=(build tests backtrace smoke memcheck racecheck synccheck bench profile)
SANITIZER_TOOLS=(memcheck racecheck synccheck)
declare -A BUDGET=([build]=200 [tests]=280 [backtrace]=60 [smoke]=90 [memcheck]=90 [racecheck]=120 [synccheck]=60 [bench]=150 [profile]=90)
declare -A PHASE_STEPS=([tests]="build tests backtrace smoke" [sanitize]="build memcheck racecheck synccheck bench" [profile]="build profile" [all]="${ALL_STEPS[*]}")

usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}
die_usage() {
  echo "gpu_check: $1" >&2
  echo "usage: scripts/gpu_check.sh [tests|sanitize|profile|all] [OUT_DIR] [--steps LIST] [--deadline SECONDS] [--dry-run] (--help for more)" >&2
  exit 2
}
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

phase="" out_dir="" steps_arg="" dry=0 deadline=${GPU_CHECK_DEADLINE:-}
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --steps) [ $# -ge 2 ] || die_usage "--steps needs a list of steps"; steps_arg=$2; shift ;;
    --steps=*) steps_arg=${1#--steps=} ;;
    --deadline) [ $# -ge 2 ] || die_usage "--deadline needs a number of seconds"; deadline=$2; shift ;;
    --deadline=*) deadline=${1#--deadline=} ;;
    -*) die_usage "unknown option '$1'" ;;
    tests | sanitize | profile | all)
      if [ -z "$phase" ] && [ -z "$out_dir" ]; then phase=$1
      else die_usage "the phase comes first, once: got '$1' after '${phase:-$out_dir}' (a folder of that name: ./$1)"; fi ;;
    *) [ -z "$out_dir" ] || die_usage "one output folder only, got '$out_dir' and '$1'"; out_dir=$1 ;;
  esac
  shift
done
phase=${phase:-all}
if [ -z "$deadline" ]; then
  if [ "$phase" = all ]; then deadline=540; else deadline=470; fi
fi
is_uint "$deadline" || die_usage "the deadline must be a whole number of seconds, got '$deadline'"
steps=()
if [ -n "$steps_arg" ]; then
  for s in ${steps_arg//,/ }; do
    if [ "$s" = sanitize ]; then steps+=("${SANITIZER_TOOLS[@]}"); continue; fi
    [[ -n "${BUDGET[$s]+x}" ]] || die_usage "unknown step '$s'; the steps are: ${ALL_STEPS[*]} (sanitize: the three tools)"
    steps+=("$s")
  done
  [ ${#steps[@]} -gt 0 ] || die_usage "--steps names no step"
else
  read -r -a steps <<<"${PHASE_STEPS[$phase]}"
fi
for s in "${ALL_STEPS[@]}"; do
  var="GPU_CHECK_BUDGET_${s^^}"
  if [ -n "${!var:-}" ]; then
    { is_uint "${!var}" && [ "${!var}" -ge 1 ]; } || die_usage "$var must be a whole number of seconds >= 1, got '${!var}'"
    BUDGET[$s]=${!var}
  fi
done
# One test process per CPU but two, at most 14 (torch.compile and opcheck tests are CPU-bound; an
# H100/H200 machine has 16 CPUs and room on the GPU for every process's context).
cpus=$(nproc 2>/dev/null || echo 8)
default_workers=$((cpus > 16 ? 14 : (cpus > 3 ? cpus - 2 : 1)))
workers=${GPU_CHECK_WORKERS:-$default_workers}
{ is_uint "$workers" && [ "$workers" -ge 1 ]; } || die_usage "GPU_CHECK_WORKERS must be a whole number >= 1, got '$workers'"
out_dir=${out_dir:-${OUT:-gpu_check_out}}
mkdir -p "$out_dir" || die_usage "cannot create the output folder '$out_dir'"
out_dir=$(cd "$out_dir" && pwd)
summary="$out_dir/summary.md"

# Tools: nvcc and compute-sanitizer from PATH, CUDA_HOME or /usr/local/cuda.
for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin; do
  if [ -d "$d" ] && ! command -v nvcc >/dev/null 2>&1 && [ -x "$d/nvcc" ]; then PATH="$PATH:$d"; fi
done
sanitizer=$(command -v compute-sanitizer 2>/dev/null || true)
for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
  if [ -z "$sanitizer" ] && [ -x "$d/compute-sanitizer" ]; then sanitizer="$d/compute-sanitizer"; PATH="$PATH:$d"; fi
done
# The debugger of the backtrace step: cuda-gdb (it debugs the host code too), else gdb;
# GPU_CHECK_DEBUGGER names another one, or "none".
if [ -n "${GPU_CHECK_DEBUGGER:-}" ]; then
  debugger=""
  [ "$GPU_CHECK_DEBUGGER" = none ] || debugger=$(command -v "$GPU_CHECK_DEBUGGER" 2>/dev/null || true)
else
  debugger=$(command -v cuda-gdb 2>/dev/null || true)
  for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin; do
    if [ -z "$debugger" ] && [ -x "$d/cuda-gdb" ]; then debugger="$d/cuda-gdb"; fi
  done
  [ -n "$debugger" ] || debugger=$(command -v gdb 2>/dev/null || true)
fi

ncu_bin=$(command -v ncu 2>/dev/null || true)
for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin /opt/nvidia/nsight-compute/*; do
  if [ -z "$ncu_bin" ] && [ -x "$d/ncu" ]; then ncu_bin="$d/ncu"; fi
done

# The interpreter's own bin/ (a virtual environment's: its ninja) ahead on PATH, as an activated
# environment would have it: torch's extension build runs `ninja` from PATH.
pybin=$(dirname "$(command -v "$PYTHON" 2>/dev/null || echo /nonexistent/python)")
if [ -x "$pybin/ninja" ] && [ "$(command -v ninja 2>/dev/null)" != "$pybin/ninja" ]; then PATH="$pybin:$PATH"; fi

# What the machine has, first (also into summary.md).
machine=$("$PYTHON" scripts/gpu.py env 2>&1)
echo "$machine"

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

tests_sel=(-m cuda)
[ "${GPU_CHECK_TESTS:-gpu}" = "all" ] && tests_sel=()
if [ "$workers" -gt 1 ] && "$PYTHON" -c "import xdist" >/dev/null 2>&1; then tests_sel+=(-n "$workers"); fi
slow=0
[ "${GPU_CHECK_SLOW:-0}" = "1" ] && slow=1
jobs=$(nproc 2>/dev/null || echo 4)

# The command of each step (an array per step; the sanitizer steps run sanitize_cmd under their tool).
build_cmd=(env -u DILATED_ATTENTION_CPU_ONLY FORCE_CUDA=1 "TORCH_CUDA_ARCH_LIST=$arch"
  "DILATED_ATTENTION_NVCC_FLAGS=-Xptxas -v" "MAX_JOBS=$jobs" "$PYTHON" setup.py build_ext --inplace)
# -v: one line per test as it ends ("[gw3] [ 12%] FAILED tests/..."), so that a run cut by its time
# limit still names every result so far; --tb=short keeps the tracebacks (printed at the end) short.
tests_cmd=(env "DILATED_ATTENTION_SLOW=$slow" "$PYTHON" -m pytest -v --tb=short -rfEs --durations=25 -p no:cacheprovider
  tests/cuda/test_decode_cuda.py tests/backends/test_backends_views.py tests/cuda/test_cuda.py tests/ring/test_ring_pieces.py "${tests_sel[@]}")
smoke_cmd=("$PYTHON" scripts/gpu.py smoke --cases errors small large sm90)
sanitize_cmd=("$PYTHON" scripts/gpu.py smoke --cases sanitize)
read -r -a bench_extra <<<"${GPU_CHECK_BENCH_ARGS:-}"  # e.g. "--tokens 262144": fewer configurations
profile_cmd=("${ncu_bin:-ncu}" --clock-control none --kernel-name "regex:tc(90)?_(fwd|dq|dkv)_kernel" --launch-count 6
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis "$PYTHON" scripts/gpu.py profile)
bench_cmd=("$PYTHON" benchmarks/bench_cuda.py "${bench_extra[@]}" --out "$out_dir/bench" --budget)  # + seconds, at run time
# backtrace: each crashed test alone, in one process, under the debugger (+ the python executable
# and the test, at run time); the debugger stops at the fatal signal and prints the native stack.
max_backtraces=3
debugger_cmd=(-batch -ex "set print thread-events off" -ex run -ex bt -ex quit --args)
pytest_alone=(-m pytest -x -q -p no:cacheprovider -p no:xdist)

# The in-place build is up to date when it has CUDA kernels and was built by this script from the
# same sources, setup.py and architecture (build/gpu_check.stamp).
stamp_file=${GPU_CHECK_STAMP:-build/gpu_check.stamp}
source_stamp() {
  { echo "arch $arch"; find csrc setup.py -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \) -print0 |
    sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1
}
has_cuda_kernels() {
  "$PYTHON" -c 'import sys, dilated_attention.op as o; sys.exit(0 if o.has_kernel("cuda") else 1)' >/dev/null 2>&1
}
build_is_current() {
  [ "${GPU_CHECK_REBUILD:-0}" != 1 ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$(source_stamp)" ] && has_cuda_kernels
}

show() { printf '%q ' "$@"; }
if [ "$dry" = 1 ]; then
  echo "gpu_check (dry run): phase $phase, GPU ${gpu_name} (sm_${arch/./}), output folder $out_dir, deadline ${deadline} s"
  for s in "${steps[@]}"; do
    case $s in
      build) echo "build (${BUDGET[build]} s, skipped when up to date): $(show "${build_cmd[@]}")> build.log" ;;
      tests) echo "tests (${BUDGET[tests]} s): $(show "${tests_cmd[@]}")> tests.log" ;;
      backtrace)
        if [ -n "$debugger" ]; then
          echo "backtrace (${BUDGET[backtrace]} s, only after a crash in tests.log): $(show env "DILATED_ATTENTION_SLOW=$slow" "$debugger" "${debugger_cmd[@]}" "$PYTHON" "${pytest_alone[@]}")CRASHED_TEST >> tests.log (each crashed test, at most $max_backtraces)"
        else
          echo "backtrace (${BUDGET[backtrace]} s, only after a crash in tests.log): neither cuda-gdb nor gdb here: crashed tests would not be rerun"
        fi ;;
      smoke) echo "smoke (${BUDGET[smoke]} s): $(show "${smoke_cmd[@]}")> smoke.log" ;;
      memcheck | racecheck | synccheck)
        echo "$s (${BUDGET[$s]} s): ${sanitizer:-compute-sanitizer} --tool $s --error-exitcode 3 --print-limit 30 $(show "${sanitize_cmd[@]}")>> sanitize.log" ;;
      bench) echo "bench (${BUDGET[bench]} s): $(show "${bench_cmd[@]}")$((BUDGET[bench] - 30)) > bench.md, bench.csv, bench.png" ;;
      profile) echo "profile (${BUDGET[profile]} s): $(show "${profile_cmd[@]}")> summary.md (key lines)" ;;
    esac
  done
  exit 0
fi

# A build that is needed and cannot run stops everything here, saying why.
if [[ " ${steps[*]} " == *" build "* ]] && ! build_is_current; then
  if ! why=$("$PYTHON" scripts/gpu.py env --need-build 2>&1); then
    echo "$why" | grep "cannot build" >&2
    { echo "# GPU check: stopped, the extension cannot be built here"; echo; echo '```'; echo "$why"; echo '```'; } >"$summary"
    exit 3
  fi
fi

start_all=$(date +%s)
left() { echo $((deadline - ($(date +%s) - start_all))); }
# Runs "$@" with a time limit, output appended to a log; prints the exit status (124: out of time).
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

declare -A STATUS SECS
# A step that passed, or a backtrace step with no crash to look at ("done" follows crashes: no pass).
step_ok() { [[ "$1" == pass* || "$1" == "not needed"* ]]; }
built_ok=1
for s in "${steps[@]}"; do
  remaining=$(left)
  budget=${BUDGET[$s]}
  floor=30  # a step does not start with less time than this (or than its whole budget)
  [ "$budget" -lt "$floor" ] && floor=$budget
  [ "$remaining" -lt "$budget" ] && budget=$remaining
  if [ "$s" = backtrace ]; then  # only when tests.log names crashed tests
    crashed=()
    [ -f "$out_dir/tests.log" ] &&
      mapfile -t crashed < <("$PYTHON" scripts/gpu.py testlog crashed "$out_dir/tests.log" --max "$max_backtraces" 2>/dev/null)
    if [ ${#crashed[@]} -eq 0 ]; then
      STATUS[$s]="not needed (no crashed test in tests.log)"
      SECS[$s]=0
      continue
    fi
  fi
  if [ "$s" = build ] && build_is_current; then
    STATUS[$s]="pass (up to date: not rebuilt)"
    SECS[$s]=0
    echo "gpu_check: build: the in-place build is up to date (sm_${arch/./}), not rebuilt"
    continue
  fi
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
      rm -f "$stamp_file"
      rc=$(run_logged "$budget" "$log" "${build_cmd[@]}")
      if [ "$rc" = 0 ] && ! has_cuda_kernels; then
        echo "gpu_check: the build finished but dilated_attention has no CUDA kernels" >>"$log"
        rc=1
      fi
      if [ "$rc" = 0 ]; then mkdir -p "$(dirname "$stamp_file")" && source_stamp >"$stamp_file"; else built_ok=0; fi
      ;;
    tests | smoke)
      log="$out_dir/$s.log"
      : >"$log"
      if [ "$s" = tests ]; then rc=$(run_logged "$budget" "$log" "${tests_cmd[@]}")
      else rc=$(run_logged "$budget" "$log" "${smoke_cmd[@]}"); fi
      ;;
    backtrace)
      log="$out_dir/tests.log"  # appended after pytest's own output
      if [ -z "$debugger" ]; then
        echo "===== gpu_check backtrace: neither cuda-gdb nor gdb found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin); not rerun: ${crashed[*]}" >>"$log"
        echo "gpu_check: backtrace: neither cuda-gdb nor gdb found; the crashed tests are not rerun"
        rc=unavailable
      else
        # The interpreter itself, not a wrapper script (a pyenv shim) that the debugger cannot load.
        py_exe=$("$PYTHON" -c 'import sys; print(sys.executable)' 2>/dev/null | tail -1)
        [ -x "$py_exe" ] || py_exe=$PYTHON
        n=0 reran=0
        for t in "${crashed[@]}"; do
          n=$((n + 1))
          # The first crash gets most of the time (up to 40 s): the debugger and torch start slowly.
          step_left=$((budget - ($(date +%s) - t0)))
          each=$((step_left < 40 ? step_left : 40))
          [ $((step_left / (${#crashed[@]} - n + 1))) -gt "$each" ] && each=$((step_left / (${#crashed[@]} - n + 1)))
          if [ "$each" -lt 10 ]; then
            echo "===== gpu_check backtrace $n of ${#crashed[@]}: $t: not rerun, the step's ${budget} s are spent" >>"$log"
            continue
          fi
          printf '\n===== gpu_check backtrace %s of %s: %s (%s, limit %s s) =====\n' "$n" "${#crashed[@]}" "$t" "$(basename "$debugger")" "$each" >>"$log"
          r=$(run_logged "$each" "$log" env DEBUGINFOD_URLS= "DILATED_ATTENTION_SLOW=$slow" "$debugger" "${debugger_cmd[@]}" "$py_exe" "${pytest_alone[@]}" "$t")
          echo "----- gpu_check backtrace $n: exit status $r$([ "$r" = 124 ] || [ "$r" = 137 ] && echo " (out of time)")" >>"$log"
          reran=$((reran + 1))
        done
        rc=rerun
      fi
      ;;
    bench)
      log="$out_dir/bench.log"  # kept in summary.md: the benchmark writes bench.md itself
      : >"$log"
      rc=$(run_logged "$budget" "$log" "${bench_cmd[@]}" $((budget > 60 ? budget - 30 : budget / 2)))
      ;;
    profile)
      log="$out_dir/profile.log"  # its key lines go into summary.md: at most 8 files in the folder
      : >"$log"
      if [ -z "$ncu_bin" ]; then
        echo "gpu_check: ncu (Nsight Compute) not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)" >>"$log"
        rc=unavailable
      else
        rc=$(run_logged "$budget" "$log" "${profile_cmd[@]}")
      fi
      ;;
    memcheck | racecheck | synccheck)
      log="$out_dir/sanitize.log"
      [ -n "${sanitize_started:-}" ] || : >"$log"
      sanitize_started=1
      printf '\n===== compute-sanitizer --tool %s (limit %s s) =====\n' "$s" "$budget" >>"$log"
      if [ -z "$sanitizer" ]; then
        echo "gpu_check: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)" >>"$log"
        rc=unavailable
      else
        extra=()
        [ "$s" = memcheck ] && extra=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)  # each tensor its own allocation
        before=$(wc -l <"$log")
        rc=$(run_logged "$budget" "$log" "${extra[@]}" "$sanitizer" --tool "$s" --error-exitcode 3 --print-limit 30 "${sanitize_cmd[@]}")
        echo "===== $s: exit status $rc" >>"$log"
        if [ "$rc" != 0 ] && tail -n +"$before" "$log" | grep -qiE "device not supported|not supported on this"; then rc=unavailable; fi
      fi
      ;;
  esac
  SECS[$s]=$(($(date +%s) - t0))
  cap_log "$log"
  case $rc in
    0) STATUS[$s]=pass ;;
    124 | 137) STATUS[$s]="FAIL: out of time (${budget} s)" ;;
    rerun) STATUS[$s]="done: ${reran} of ${#crashed[@]} crashed tests rerun under $(basename "$debugger") (tests.log)" ;;
    unavailable)
      if [ "$s" = backtrace ]; then STATUS[$s]="unavailable: neither cuda-gdb nor gdb here (${#crashed[@]} crashed tests not rerun)"
      elif [ "$s" = profile ]; then STATUS[$s]="unavailable: ncu (Nsight Compute) not found"
      else STATUS[$s]="unavailable: compute-sanitizer cannot run here (see sanitize.log)"; fi ;;
    *) STATUS[$s]="FAIL (exit status $rc)" ;;
  esac
  if [ "$s" = tests ] && crashes=$(grep -c "Fatal Python error" "$log") && [ "$crashes" -gt 0 ]; then
    STATUS[$s]="${STATUS[$s]}; ${crashes} crashes (Fatal Python error)"
  fi
  echo "gpu_check: $s: ${STATUS[$s]} (${SECS[$s]} s)"
done
# summary.md (GPU_CHECK_COMMIT names the commit where the tree has no .git): what ran where, each step's status, and the lines that matter from each log.
# The project's own commit only: a copy of the project without its .git inside another repository
# would otherwise report that repository's HEAD.
own_git() { [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ]; }
if own_git; then
  commit=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD)}
  dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | head -1)
else
  commit=${GPU_CHECK_COMMIT:-"unknown (no git history in this copy; set GPU_CHECK_COMMIT)"}
  dirty=""
fi
{
  echo "# GPU check of the native CUDA kernels: $phase"
  echo
  echo "- GPU: ${gpu_name} (sm_${arch/./}); torch ${torch_version}, CUDA ${cuda_version}"
  echo "- commit: ${commit}${dirty:+ (with uncommitted changes)}; $(date -u '+%Y-%m-%d %H:%M UTC')"
  command -v nvidia-smi >/dev/null 2>&1 &&
    echo "- nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo '```'
  echo "$machine"
  echo '```'
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
  if [ -f "$out_dir/tests.log" ]; then
    # The results (from the per-test lines when pytest was cut before its count), the failed,
    # errored and crashed tests, the slowest tests, the backtraces (scripts/gpu.py testlog).
    echo
    if ! tests_summary=$("$PYTHON" scripts/gpu.py testlog summary "$out_dir/tests.log" 2>&1); then
      tests_summary=$(echo "## tests"; echo; echo '```'
        grep -E "^(FAILED|ERROR|SKIPPED)| (FAILED|ERROR) |passed|failed|Fatal Python error" "$out_dir/tests.log" | tail -60
        echo '```')
    fi
    echo "$tests_summary"
  fi
  if [ -f "$out_dir/smoke.log" ]; then
    echo
    echo "## smoke"
    echo '```'
    grep -E "^(PASS|FAIL|SKIP|  )|gpu_smoke|dense bf16|GPU:" "$out_dir/smoke.log" | tail -60
    echo '```'
  fi
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
    grep -v "configurations:" "$out_dir/bench.log" | tail -80
    echo '```'
  fi
  if [ -f "$out_dir/profile.log" ]; then
    echo
    echo "## Nsight Compute: the tensor-core kernels (key lines; ncu's advice: first line of each)"
    echo '```'
    grep -E "tc(90)?_(fwd|dq|dkv)_kernel|^==PROF==|==ERROR==|not found|Duration|Compute \(SM\) Throughput|^ *Memory Throughput|DRAM Throughput|L1/TEX Hit Rate|L2 Hit Rate|Registers Per Thread|Shared Memory Configuration Size|Dynamic Shared Memory Per Block|Theoretical Occupancy|Achieved Occupancy|Block Limit|Executed Ipc Active|Issue Slots Busy|Warp Cycles Per Issued Instruction|^ *(OPT|WRN|INF) " "$out_dir/profile.log" |
      cut -c1-200 | head -300
    echo '```'
  fi
  all_passed=1
  for s in "${steps[@]}"; do step_ok "${STATUS[$s]}" || all_passed=0; done
  if [ "$all_passed" = 1 ]; then
    families='"tensor-core", "simt"'
    [ "${arch%%.*}" -ge 8 ] || families='"simt"'  # below sm_80 every dtype runs on the SIMT kernels
    echo
    echo "## Record"
    echo
    echo "Every step of this command passed. Once both commands (\`tests\` and \`sanitize\`) have passed on this"
    echo "commit, add this entry to \"verified\" in dilated_attention/gpu_records.json so that \`auto\` picks"
    echo "\`native\` on GPUs of this compute capability:"
    echo
    echo '```json'
    echo "    {\"capability\": [${arch%%.*}, ${arch#*.}], \"gpu\": \"${gpu_name}\", \"commit\": \"${GPU_CHECK_COMMIT:-$(own_git && git rev-parse --short HEAD || echo unknown)}\", \"date\": \"$(date -u +%Y-%m-%d)\", \"families\": [${families}], \"source\": \"benchmarks/results/...\"}"
    echo '```'
  fi
  if [ "$phase" = tests ] && [ -z "$steps_arg" ]; then
    echo
    echo "Next: \`scripts/gpu_check.sh sanitize\` (compute-sanitizer and the benchmark; reuses this build)."
  fi
} >"$summary"
rm -f "$out_dir/bench.log" "$out_dir/profile.log"  # kept in summary.md: at most 8 files in the folder
echo "gpu_check: wrote $summary"
for s in "${steps[@]}"; do
  step_ok "${STATUS[$s]}" || exit 1
done
exit 0
