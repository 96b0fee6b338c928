"""Run a long command of the Makefile so that no minute passes in silence.

``python scripts/progress.py LABEL -- COMMAND...`` runs COMMAND, shows its output, and prints
``LABEL: still running (N min)`` after every minute without output (pip installing gigabytes of
wheels prints nothing for minutes). With ``--compile`` it shows, of a verbose extension build,
one line per compiled source (``LABEL: [3/14] csrc/cpu/forward.cpp``, from ninja's counter) and
the build's own ``dilated_attention:`` lines instead of the compiler command lines; ``--hide
REGEX`` leaves out the lines it matches (a build's hundreds of ``copying ...`` lines). The whole
output goes to ``--log``; when the command fails, its last lines are printed. Exits with the
command's exit status.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

QUIET_S = 60.0
# ninja -v: "[3/14] /usr/bin/c++ ... -c /abs/path/csrc/cpu/forward.cpp -o ..."
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]\s.*?\s(\S+\.(?:cpp|cu|cc|c))\s+-o\s")


def _shown(line: str, compile_mode: bool, hide: re.Pattern | None = None) -> str | None:
    """The line to print for ``line`` of the command's output, or None to keep it in the log only."""
    if hide is not None and hide.search(line):
        return None
    if not compile_mode:
        return line
    line = line.strip()  # pip -v indents the build's output
    m = _NINJA.match(line)
    if m:
        source = m[3].strip("'\"")
        parts = source.split(os.sep)
        inside = parts[parts.index("csrc") :] if "csrc" in parts else parts[-1:]
        return f"[{m[1]}/{m[2]}] {os.sep.join(inside)}"
    if line.startswith(("dilated_attention:", "error", "ERROR", "Successfully")) or ": error" in line:
        return line
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("label")
    parser.add_argument("--compile", action="store_true", help="show one line per compiled source")
    parser.add_argument("--hide", default=None, help="leave out the lines this regular expression matches")
    parser.add_argument("--log", default=None, help="file for the whole output")
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        parser.error("give the command after --")
    cut = argv.index("--")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not command:
        parser.error("no command given after --")
    hide = re.compile(args.hide) if args.hide else None
    log = open(args.log, "w") if args.log else None
    tail: list[str] = []
    last = [time.monotonic()]
    start = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(5.0):
            if time.monotonic() - last[0] >= QUIET_S:
                print(f"{args.label}: still running ({(time.monotonic() - start) / 60:.0f} min)", flush=True)
                last[0] = time.monotonic()

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        if log:
            log.write(raw)
        tail = [*tail[-39:], line]
        shown = _shown(line, args.compile, hide)
        if shown is not None:
            print(f"{args.label}: {shown}" if args.compile else shown, flush=True)
            last[0] = time.monotonic()
    rc = proc.wait()
    done.set()
    if log:
        log.close()
    if rc != 0 and (args.compile or hide is not None):
        print(f"{args.label}: failed (exit {rc}); the last lines of its output:", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
        if args.log:
            print(f"{args.label}: the whole output is in {args.log}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
