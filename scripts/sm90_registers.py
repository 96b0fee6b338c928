"""The registers ptxas gave each sm90 (wgmma) kernel, read from its ``-Xptxas -v`` report.

The warp-specialised kernels (csrc/cuda/tc90_kernels.cuh) launch 384 threads and then split the
block's registers with ``setmaxnreg``: the producer warpgroup gives some back (kTc90ProducerRegs)
and the two consumer warpgroups take them (kTc90ConsumerRegs), which adds up only when every thread
started with kTc90LaunchRegs (168), all a 384-thread block can have; the numbers are read from
csrc/cuda/tc90_pipe.cuh. A kernel that ptxas compiled to fewer registers at launch would have its consumers wait in
``setmaxnreg.inc`` for registers that never come: a hang, not an error. So each ``tc90_*`` kernel
must report exactly ``--expect`` registers (kTc90LaunchRegs), no spill stores, and none of ptxas's
notes that it inserted a wgmma fence or wait (C7519, C7517) or serialised the wgmmas (C7514, C7520).

    python scripts/sm90_registers.py LOG [LOG ...] [--expect N]

Prints one line per tc90 kernel (name, registers, spill stores) and a verdict; exits 1 when a
kernel breaks a rule or when the logs hold no tc90 kernel at all (the build has no sm_90a code),
2 on a usage error. ``scripts/check_sm90a.sh`` (the compile check, no GPU) and
``scripts/sm90_first_run.sh`` (the build on the GPU) read their logs with it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_HEADER = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "tc90_pipe.cuh"
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores")
_USED = re.compile(r"Used (\d+) registers")
_NOTES = {
    "C7519": "ptxas inserted a wgmma fence (an accumulator is touched between wgmmas)",
    "C7517": "ptxas inserted a wgmma wait",
    "C7514": "ptxas serialises the wgmmas (a product under a condition)",
    "C7520": "ptxas serialises the wgmmas (an accumulator read in flight)",
}


def register_split(header: Path = _HEADER) -> dict[str, int]:
    """kTc90LaunchRegs, kTc90ProducerRegs and kTc90ConsumerRegs as the kernels' header sets them."""
    text = header.read_text()
    split = {}
    for name in ("kTc90LaunchRegs", "kTc90ProducerRegs", "kTc90ConsumerRegs"):
        m = re.search(rf"\b{name} = (\d+)", text)
        if m is None:
            raise SystemExit(f"sm90_registers: {header} does not set {name}")
        split[name] = int(m.group(1))
    return split


@dataclass
class Kernel:
    mangled: str
    registers: int
    spill_stores: int

    @property
    def name(self) -> str:
        """``tc90_fwd_kernel<__half, 64, false>``-like, from the mangled name (c++filt where present)."""
        if shutil.which("c++filt"):
            out = subprocess.run(["c++filt", self.mangled], capture_output=True, text=True).stdout.strip()
            if out and out != self.mangled:
                return re.sub(r"^void |dilated_attention::cuda::|\(.*\)$", "", out)
        m = re.search(r"(tc90_\w+?_kernel)", self.mangled)
        return m.group(1) if m else self.mangled


def parse(text: str) -> tuple[list[Kernel], list[str]]:
    """The kernels of a ptxas -v report (entry, spill line, register line, in that order) and the
    C75xx notes it holds."""
    kernels: list[Kernel] = []
    name, spills = None, 0
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            name, spills = m.group(1), 0
            continue
        m = _SPILLS.search(line)
        if m and name is not None:
            spills = int(m.group(1))
            continue
        m = _USED.search(line)
        if m and name is not None:
            kernels.append(Kernel(name, int(m.group(1)), spills))
            name = None
    notes = sorted({code for code in _NOTES if code in text})
    return kernels, notes


def check(kernels: list[Kernel], notes: list[str], expect: int, split: str = "") -> list[str]:
    """What breaks the rules, one line each (empty: all well)."""
    tc90 = [k for k in kernels if "tc90_" in k.mangled and "probe" not in k.mangled]
    if not tc90:
        return ["no tc90 kernel in the report: the build has no sm_90a code of the wgmma kernels"]
    bad = []
    for k in tc90:
        if k.registers != expect:
            bad.append(
                f"{k.name}: {k.registers} registers at launch where setmaxnreg's split needs "
                f"{expect}{split} (its consumers would wait for registers forever)"
            )
        if k.spill_stores:
            bad.append(f"{k.name}: {k.spill_stores} bytes of spill stores")
    bad += [f"{code}: {_NOTES[code]}" for code in notes]
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    regs = register_split()
    p.add_argument(
        "--expect",
        type=int,
        default=regs["kTc90LaunchRegs"],
        help="registers each tc90 kernel must start with (default: kTc90LaunchRegs)",
    )
    args = p.parse_args(argv)
    split = f" (128 x {regs['kTc90ProducerRegs']} + 256 x {regs['kTc90ConsumerRegs']})"
    kernels: list[Kernel] = []
    notes: set[str] = set()
    for log in args.logs:
        if not log.is_file():
            p.error(f"no such log: {log}")
        k, n = parse(log.read_text(errors="replace"))
        kernels += k
        notes.update(n)
    for k in kernels:
        if "tc90_" in k.mangled:
            spill = f", {k.spill_stores} bytes of spill stores" if k.spill_stores else ""
            print(f"  {k.name:<60} {k.registers:4d} registers{spill}")
    bad = check(kernels, sorted(notes), args.expect, split)
    for line in bad:
        print(f"sm90_registers: {line}", file=sys.stderr)
    if bad:
        return 1
    count = sum("tc90_" in k.mangled and "probe" not in k.mangled for k in kernels)
    print(
        f"sm90_registers: every tc90 kernel ({count}) starts with {args.expect} registers for setmaxnreg's "
        f"split{split} and spills nothing"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
