"""The extension must use the process's one libstdc++, never carry a copy of its own.

An extension linked with libstdc++'s static archive (``-static-libstdc++``, from LDFLAGS, a
compiler's specs or a toolchain that links it so by default) holds a second copy of the stream and
locale code: ``std::locale``'s facet ids, the classic locale and the ``num_put`` facet that formats
numbers. Building an error message (``TORCH_CHECK`` streams its arguments into a
``std::ostringstream``) then mixes the two copies' locale state. Seen with this extension: the
number in the message is dropped ("head dim must be in [1, " and nothing after) where the two
copies are the same version, and a segmentation fault inside ``basic_ostream::_M_insert<long>``
on the second refused call where they are not: a user's bad argument ends the process.

* :func:`link_args`: linker arguments that resolve libstdc++ from its shared library before the
  compiler driver's own ``-lstdc++`` (which ``-static-libstdc++`` makes the static archive), so
  nothing is taken from the archive;
* :func:`problems`: what is wrong with a built library (no ``libstdc++.so`` among its needed
  libraries, or definitions of libstdc++'s locale and stream internals), read with binutils'
  ``readelf`` and ``nm``.

``python scripts/check_libstdcxx.py LIBRARY...`` prints the problems and exits 1 if there are any
(``setup.py`` runs the same check after every build, ``scripts/check_cuda_build.sh`` on the CUDA
build).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

__all__ = ["LIBSTDCXX_INTERNALS", "link_args", "loaded_libstdcxx", "problems"]

#: Symbols (demangled) that only libstdc++ itself defines: a library that defines one carries a copy
#: of libstdc++'s locale and stream code. Inline template code that every TU may instantiate
#: (``std::operator<<`` for ``const char*``, say) is not among them.
LIBSTDCXX_INTERNALS = re.compile(
    r"\bstd::(locale::|codecvt<|ios_base::|__cxx11::numpunct|numpunct<|num_put<|"
    r"basic_ostream<char, std::char_traits<char> >::_M_insert<|basic_ios<char, std::char_traits<char> >::init)"
)


def loaded_libstdcxx() -> str | None:
    """The path of the libstdc++ this process has loaded (torch's), from ``/proc/self/maps``; None
    when there is none or no such file (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        return None
    return None


def link_args() -> list[str]:
    """Linker arguments that take libstdc++ and libgcc from their shared libraries (Linux, GCC or
    Clang driver): placed before the driver's own ``-lstdc++``, they resolve every libstdc++ symbol
    from ``libstdc++.so``, so a ``-static-libstdc++`` from elsewhere links nothing from the archive.

    libstdc++ is named by its file, not by ``-lstdc++``: the linker takes the first directory that
    holds ``libstdc++.so`` *or* ``libstdc++.a``, and a relocated toolchain (a compiler copied under
    its own prefix, whose ``libstdc++.so`` link points nowhere) has only the archive in its own
    library directory, which comes first. The file is the one this process runs with (torch's,
    so the one the extension will be loaded next to), else ``-l:libstdc++.so.6`` (that exact name
    on the search path)."""
    if not sys.platform.startswith("linux"):
        return []
    lib = loaded_libstdcxx()
    return [
        "-shared-libgcc",
        "-Wl,--push-state,-Bdynamic,--no-as-needed",
        lib if lib is not None else "-l:libstdc++.so.6",
        "-Wl,--pop-state",
    ]


def _run(tool: str, *args: str) -> str | None:
    exe = shutil.which(tool)
    if exe is None:
        return None
    done = subprocess.run([exe, *args], capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else None


def problems(path: str) -> list[str] | None:
    """What makes the shared library at ``path`` carry its own libstdc++ (empty: nothing), or None
    when binutils' ``readelf`` and ``nm`` are not there to read it."""
    dynamic = _run("readelf", "-d", "-W", path)
    symbols = _run("nm", "-C", "--defined-only", path)
    if dynamic is None or symbols is None:
        return None
    found = []
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    if not any(n.startswith("libstdc++.so") for n in needed):
        found.append(f"libstdc++.so is not among its needed libraries ({', '.join(needed) or 'none'})")
    defined = sorted(
        {
            line.split(" ", 2)[2]
            for line in symbols.splitlines()
            if line.count(" ") >= 2 and LIBSTDCXX_INTERNALS.search(line)
        }
    )
    if defined:
        more = f" and {len(defined) - 3} more" if len(defined) > 3 else ""
        found.append(
            f"it defines {len(defined)} of libstdc++'s own locale/stream symbols "
            f"({'; '.join(defined[:3])}{more}): it was linked with libstdc++'s static archive"
        )
    return found


def message(path: str, found: list[str]) -> str:
    """The error that names the library, what is wrong and what to do."""
    return (
        f"{os.path.basename(path)} carries its own copy of libstdc++: {'; '.join(found)}. Its error "
        "messages then format numbers with a second copy of libstdc++'s locale code (wrong messages, "
        "or a segmentation fault on a refused call). Remove -static-libstdc++ from LDFLAGS and the "
        f"compiler's flags, or build with another compiler ({compilers()}), and rebuild."
    )


def compilers() -> str:
    """The compilers the build takes from the environment (CC, CXX), for the error message."""
    named = [f"{var}={os.environ[var]}" for var in ("CC", "CXX") if os.environ.get(var)]
    return ", ".join(named) if named else "CC and CXX are unset: the default c++"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python scripts/check_libstdcxx.py LIBRARY...", file=sys.stderr)
        return 2
    status = 0
    for path in argv:
        found = problems(path)
        if found is None:
            print(f"check_libstdcxx: readelf/nm (binutils) not found; {path} not checked")
        elif found:
            print(f"check_libstdcxx: {message(path, found)}", file=sys.stderr)
            status = 1
        else:
            print(f"check_libstdcxx: {os.path.basename(path)} uses the shared libstdc++ only")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
