#!/usr/bin/env bash
# The first run of the sm90 (wgmma) kernels on an H100/H200, in one command of under 10 minutes,
# whose summary says at a glance whether they hang, compute wrong values, or are slow:
#
#   1. build      scripts/gpu_check.sh tests --steps build (sm_90a for the visible GPU, ptxas -v)
#   2. registers  scripts/sm90_registers.py on the build log: every tc90 kernel starts with the 168
#                 registers its setmaxnreg split needs (fewer: its consumers would hang), no spills
#   3. smoke      scripts/gpu.py smoke --cases sm90 under a hard kill (SMOKE seconds): a hang costs
#                 that, not the whole run; the log's last RUN line names the case that hung
#   4. cp-async   on a failure or a hang, the same cases with DILATED_ATTENTION_CUDA_TMA=0 (every
#                 chunk by cp.async): separates the tensor copy engine from the pipeline
#   5. bench      benchmarks/bench_cuda.py --gpt --methods native native90 auto dense (with the
#                 setting that passed), under a hard kill: native sm90 against native per shape
#   6. profile    scripts/gpu_check.sh profile: Nsight Compute on the sm80 and sm90 kernels
#
#   scripts/sm90_first_run.sh [OUT_DIR] [--deadline SECONDS] [--dry-run]
#
# OUT_DIR defaults to $OUT when set, else sm90_first_run_out/. Files: summary.md (the verdict first,
# then each step), build.log, registers.txt, smoke.log, smoke-cp-async.log, bench.md, profile.md.
# Exit status: 0 when the kernels ran right (fast or not), 1 on a hang, wrong values, a register
# count that would hang, or a failed build; 2 on a usage error. Without a GPU of compute capability
# 9.0 it says so and exits 0.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${GPU_CHECK_PYTHON:-${PYTHON:-python3}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step_signal=KILL  # a hung kernel does not answer SIGTERM: every step under a hard kill
source scripts/session_lib.sh
session_args sm90_first_run sm90_first_run_out "${BASH_SOURCE[0]}" "$@"

# Seconds per step (a step gets at most what the deadline leaves).
BUILD=220 SMOKE=60 BENCH=130 PROFILE=100

if [ "$dry" = 0 ]; then
  cap=$("$PYTHON" -c 'import torch
print("%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "none")' 2>/dev/null)
  if [ "$cap" != "9.0" ]; then
    echo "sm90_first_run: no GPU of compute capability 9.0 here (${cap:-none}); nothing to run."
    printf '# sm90 first run: skipped\n\nno GPU of compute capability 9.0 here (%s)\n' "${cap:-none}" >"$out_dir/summary.md"
    exit 0
  fi
fi

session_step build "$BUILD" "$work/build.out" bash scripts/gpu_check.sh tests "$work/build" --steps build --deadline $((BUILD - 10))
[ -f "$work/build/build.log" ] && cp "$work/build/build.log" "$out_dir/build.log"
if [ "$dry" = 1 ] || [ -f "$out_dir/build.log" ]; then
  session_step registers 30 "$out_dir/registers.txt" "$PYTHON" scripts/sm90_registers.py "$out_dir/build.log"
fi
session_step smoke "$SMOKE" "$out_dir/smoke.log" "$PYTHON" scripts/gpu.py smoke --cases sm90
tma=1
if [ "${RC[smoke]}" != 0 ]; then
  session_step cp-async "$SMOKE" "$out_dir/smoke-cp-async.log" env DILATED_ATTENTION_CUDA_TMA=0 "$PYTHON" scripts/gpu.py smoke --cases sm90
  [ "${RC[cp-async]}" = 0 ] && tma=0
fi
if [ "${RC[smoke]}" = 0 ] || [ "$tma" = 0 ]; then
  session_step bench "$BENCH" "$work/bench.out" env DILATED_ATTENTION_CUDA_TMA=$tma "$PYTHON" benchmarks/bench_cuda.py --gpt \
    --methods native native90 auto dense --iters 5 --budget $((BENCH - 40)) --out "$work/bench/bench"
  [ -f "$work/bench/bench.md" ] && cp "$work/bench/bench.md" "$out_dir/bench.md"
  session_step profile "$PROFILE" "$work/profile.out" bash scripts/gpu_check.sh profile "$work/profile" --deadline $((PROFILE - 10))
  [ -f "$work/profile/summary.md" ] && cp "$work/profile/summary.md" "$out_dir/profile.md"
fi

# The verdict: hang, wrong, slow or fast, at a glance.
if [ "$dry" = 1 ]; then
  verdict="dry run"
elif [ "${RC[build]}" != 0 ]; then
  verdict="BUILD FAILED (build.log)"
elif [ "${RC[smoke]}" = 137 ]; then
  hung=$(grep '^RUN ' "$out_dir/smoke.log" | tail -1 | cut -d' ' -f2)
  verdict="HANG in ${hung:-the first case} with tensor maps"
  case "${RC[cp-async]:-}" in
    0) verdict+="; with DILATED_ATTENTION_CUDA_TMA=0 every case passes: the tensor copy engine's path hangs" ;;
    137) verdict+="; also with DILATED_ATTENTION_CUDA_TMA=0: the pipeline (mbarriers, setmaxnreg) hangs" ;;
    *) verdict+="; with DILATED_ATTENTION_CUDA_TMA=0: ${RC[cp-async]:-not run} (smoke-cp-async.log)" ;;
  esac
elif [ "${RC[smoke]}" != 0 ]; then
  verdict="WRONG: $(grep -c '^FAIL' "$out_dir/smoke.log") sm90 case(s) failed with tensor maps (smoke.log)"
  [ "${RC[cp-async]:-}" = 0 ] && verdict+="; all pass with DILATED_ATTENTION_CUDA_TMA=0: the tensor maps load wrong tiles"
else
  verdict="RAN RIGHT: every sm90 case passed; speed in bench.md (column sm90 / native: > 1 faster)"
fi
[ "${RC[registers]:-0}" = 1 ] && verdict+=" | REGISTERS: a tc90 kernel starts with other than 168 registers (registers.txt)"
{
  echo "# sm90 first run"
  echo
  echo "**$verdict**"
  echo
  session_table
  for f in registers.txt smoke.log smoke-cp-async.log; do
    [ -f "$out_dir/$f" ] && { echo; echo "## $f"; echo; echo '```'; tail -40 "$out_dir/$f"; echo '```'; }
  done
  [ -f "$out_dir/bench.md" ] && { echo; cat "$out_dir/bench.md"; }
} >"$out_dir/summary.md"
echo "sm90_first_run: $verdict"
case "$verdict" in
  "RAN RIGHT"* | "dry run") [[ "$verdict" == *REGISTERS* ]] && exit 1; exit 0 ;;
  *) exit 1 ;;
esac
