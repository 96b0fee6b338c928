# What the one-command GPU scripts (gpu_session.sh, sm90_first_run.sh) share, sourced by them:
#
#   session_args NAME DEFAULT_OUT SCRIPT "$@"   reads [OUT_DIR] [--deadline SECONDS] [--dry-run] [-h];
#       sets out_dir (created, absolute; $OUT when set, else DEFAULT_OUT), deadline (default 575),
#       dry (0 or 1) and work (a temporary folder removed on exit); exits 2 on a usage error, naming it.
#       The clock of the deadline starts here.
#   left                                        seconds left of the deadline
#   session_step NAME LIMIT LOG COMMAND...      COMMAND under `timeout -s $step_signal LIMIT` (TERM
#       unless the script sets KILL: a hung kernel does not answer SIGTERM), its output in LOG ("-":
#       this terminal), LIMIT cut to what the deadline leaves; a step that would get less than 20 s
#       is "not run". Records RC[NAME] (its exit status, 124 or 137 when out of time, "not-run") and
#       a row of the table. A dry run prints "NAME (LIMIT s): COMMAND" and counts LIMIT as spent.
#   session_failed                              true when a step did not pass
#   session_table                               the commit, the GPU and the table of the steps
session_args() {
  local name=$1 default_out=$2 script=$3
  shift 3
  session_name=$name out_dir="" deadline=575 dry=0
  while [ $# -gt 0 ]; do
    case "$1" in
      -h | --help) sed -n '2,/^set -uo/p' "$script" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
      --dry-run) dry=1 ;;
      --deadline) [ $# -ge 2 ] || { echo "$name: --deadline needs seconds" >&2; exit 2; }; deadline=$2; shift ;;
      --deadline=*) deadline=${1#--deadline=} ;;
      -*) echo "$name: unknown option '$1'" >&2; exit 2 ;;
      *) [ -z "$out_dir" ] || { echo "$name: one output folder only, got '$out_dir' and '$1'" >&2; exit 2; }
         out_dir=$1 ;;
    esac
    shift
  done
  [[ "$deadline" =~ ^[0-9]+$ ]] || { echo "$name: the deadline must be whole seconds, got '$deadline'" >&2; exit 2; }
  out_dir=${out_dir:-${OUT:-$default_out}}
  mkdir -p "$out_dir" && out_dir=$(cd "$out_dir" && pwd) || { echo "$name: cannot create '$out_dir'" >&2; exit 2; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  start=$(date +%s)
  spent=0  # a dry run's steps take their whole limits, so that it shows what each would get
  step_signal=${step_signal:-TERM}
  rows=()
  declare -gA RC=()
}

left() { echo $((deadline - ($(date +%s) - start) - spent)); }

session_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  [ "$limit" -le "$(left)" ] || limit=$(left)
  if [ "$limit" -lt 20 ]; then
    rows+=("| $name | not run: $(left) s left of the deadline | 0 |")
    RC[$name]=not-run
    return
  fi
  if [ "$dry" = 1 ]; then
    echo "$name (${limit} s): $*"
    spent=$((spent + limit))
    rows+=("| $name | dry run | 0 |")
    RC[$name]=0
    return
  fi
  echo "$session_name: $name (up to ${limit} s) ..."
  local t0 took what
  t0=$(date +%s)
  if [ "$log" = - ]; then timeout -s "$step_signal" "$limit" "$@"; else timeout -s "$step_signal" "$limit" "$@" >"$log" 2>&1; fi
  RC[$name]=$?
  took=$(($(date +%s) - t0))
  case "${RC[$name]}" in
    0) what=pass ;;
    124) what="FAIL: out of time (${limit} s)" ;;
    137) what="KILLED after ${limit} s (a hang)" ;;
    *) what="FAIL (exit status ${RC[$name]})" ;;
  esac
  rows+=("| $name | $what | $took |")
  echo "$session_name: $name: $what"
}

session_failed() {
  local rc
  for rc in "${RC[@]}"; do [ "$rc" = 0 ] || return 0; done
  return 1
}

session_table() {
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo unknown)"
  echo
  echo "| step | status | seconds |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${rows[@]}"
}
