#!/usr/bin/env bash
# One GPU command that measures and checks what a user's training runs on, in under 10 minutes,
# its results in at most 8 files of one folder (what a short lease on a GPU machine brings back).
# Measurements first, the long test phase last (a run cut short still brings back the numbers):
#
#   1. build: scripts/gpu_check.sh tests --steps build (the extension for the visible GPU)
#   2. attn: benchmarks/bench_cuda.py --gpt: the example GPT's attention alone (B=1, H=12, D=64,
#      bf16, causal, N = 16K, 64K, 128K): auto, native, sdpa, flex, gather+flash and dense cuDNN,
#      each one's rate per useful pair as a fraction of dense cuDNN's
#   3. gpt: benchmarks/bench_gpt.py: the example GPT at blocks 16K, 64K and 128K, dense attention
#      against auto, eager and compiled, side by side
#   4. profile: benchmarks/bench_gpt.py --profile auto:16k:eager: one profiled training step
#   5. views: the C++ views driver's cuda-marked tests (tests/backends/test_views_driver.py)
#   6. check: scripts/gpu_check.sh tests --steps tests,smoke (the cuda-marked tests, the smoke test)
#
#   scripts/gpu_session.sh [OUT_DIR] [--deadline SECONDS] [--dry-run]
#
# OUT_DIR defaults to $OUT when set, else gpu_session_out/. The deadline (default 575 s) bounds the
# whole run: every step has its own limit, the check gets what the others leave it, and a step that
# would start with less than 20 s is reported "not run". Files written: summary.md (this run's
# table, then the tables and the check's summary), attn.md, gpt.md, gpt.csv, tests.log, smoke.log,
# views.log, profile.txt. Exit status: 0 when every step passed, 1 when one did not, 2 on a usage
# error. Without a GPU it says so and exits 0. The sanitizers, the long bench_cuda.py sweep and the
# Nsight profile are `scripts/gpu_check.sh sanitize` and `scripts/gpu_check.sh profile`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${GPU_CHECK_PYTHON:-${PYTHON:-python3}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

source scripts/session_lib.sh
session_args gpu_session gpu_session_out "${BASH_SOURCE[0]}" "$@"

# Seconds each step is given (its own limit inside the command); the check gets the rest
# (on an H200 at 199db38: build 97 s, tests 246 s, smoke 36 s; views 39 s, profile 17 s).
BUILD=200 ATTN=90 GPT=170 PROFILE=25 VIEWS=40

if [ "$dry" = 0 ] && ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_session: no CUDA GPU here; nothing to check, skipping."
  printf '# GPU session: skipped\n\nno CUDA GPU here\n' >"$out_dir/summary.md"
  exit 0
fi

session_step build "$BUILD" - bash scripts/gpu_check.sh tests "$work/build" --steps build --deadline $((BUILD - 10))
# native sm90 (off by default, never run on a GPU) is left to its own command: a hang there would
# cost this step's other rows.
session_step attn "$ATTN" - "$PYTHON" benchmarks/bench_cuda.py --gpt --methods dense auto sdpa native flex gather \
  --iters 5 --budget $((ATTN - 30)) --out "$work/attn/attn"
session_step gpt "$GPT" - "$PYTHON" benchmarks/bench_gpt.py --blocks 16k,64k,128k --compile both --backends dense,auto \
  --steps 3 --warmup 1 --budget $((GPT - 40)) --out "$work/gpt"
session_step profile "$PROFILE" - "$PYTHON" benchmarks/bench_gpt.py --profile auto:16k:eager --out "$work/profile"
xdist=()
"$PYTHON" -c 'import xdist' 2>/dev/null && xdist=(-n 8)
session_step views "$VIEWS" "$out_dir/views.log" "$PYTHON" -m pytest -q -p no:cacheprovider "${xdist[@]}" -m cuda tests/backends/test_views_driver.py
check_limit=$(left)
session_step check "$check_limit" - bash scripts/gpu_check.sh tests "$work/check" --steps tests,smoke --deadline $((check_limit - 10))

if [ "$dry" = 0 ]; then
  for f in tests.log smoke.log; do [ -f "$work/check/$f" ] && cp "$work/check/$f" "$out_dir/$f"; done
  [ -f "$work/attn/attn.md" ] && cp "$work/attn/attn.md" "$out_dir/attn.md"
  for ext in md csv; do
    g=$(ls "$work/gpt"/gpt-*."$ext" 2>/dev/null | head -1)
    [ -n "$g" ] && cp "$g" "$out_dir/gpt.$ext"
  done
  p=$(ls "$work/profile"/gpt-profile-*.txt 2>/dev/null | head -1)
  [ -n "$p" ] && cp "$p" "$out_dir/profile.txt"
fi
{
  echo "# GPU session"
  echo
  session_table
  echo
  [ -f "$out_dir/attn.md" ] && { echo; cat "$out_dir/attn.md"; }
  [ -f "$out_dir/gpt.md" ] && { echo; cat "$out_dir/gpt.md"; }
  [ -f "$work/build/summary.md" ] && { echo; cat "$work/build/summary.md"; }
  [ -f "$work/check/summary.md" ] && { echo; cat "$work/check/summary.md"; }
} >"$out_dir/summary.md"
printf '%s\n' "${rows[@]}"
session_failed && exit 1
exit 0
