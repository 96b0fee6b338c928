# The command line of the one-command GPU scripts (gpu_session.sh, sm90_first_run.sh), sourced by
# them: `session_args NAME DEFAULT_OUT SCRIPT "$@"` reads [OUT_DIR] [--deadline SECONDS] [--dry-run]
# [-h], sets out_dir (created, absolute; $OUT when set, else DEFAULT_OUT), deadline (default 575),
# dry (0 or 1) and work (a temporary folder removed on exit); exits 2 on a usage error, naming it.
session_args() {
  local name=$1 default_out=$2 script=$3
  shift 3
  out_dir="" deadline=575 dry=0
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
}
