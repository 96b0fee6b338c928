"""The extension uses the process's one libstdc++ (scripts/check_libstdcxx.py): a copy of libstdc++
linked into it breaks the numbers in its error messages, and crashed the process on a refused call
on a GPU machine. No GPU needed: the check reads the built library, and the link rule is tried on a
small library built here with the same flags."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import check_libstdcxx  # noqa: E402

needs_binutils = pytest.mark.skipif(
    shutil.which("readelf") is None or shutil.which("nm") is None, reason="needs binutils (readelf, nm)"
)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

_SOURCE = """
#include <sstream>
#include <string>
std::string message(long x) { std::ostringstream s; s << "got " << x; return s.str(); }
"""


def _library(tmp_path, *flags: str) -> str:
    src = tmp_path / "m.cpp"
    src.write_text(_SOURCE)
    out = str(tmp_path / f"m{abs(hash(flags))}.so")
    subprocess.run(["g++", "-shared", "-fPIC", str(src), *flags, "-o", out], check=True, capture_output=True)
    return out


@needs_binutils
def test_the_built_extension_uses_the_shared_libstdcxx():
    import dilated_attention

    libs = glob.glob(os.path.join(os.path.dirname(dilated_attention.__file__), "_C*.so"))
    assert libs, "no built extension in the dilated_attention package"
    for lib in libs:
        assert check_libstdcxx.problems(lib) == [], lib


@needs_binutils
@needs_gxx
def test_a_static_libstdcxx_is_found(tmp_path):
    found = check_libstdcxx.problems(_library(tmp_path, "-static-libstdc++"))
    assert found and any("not among its needed libraries" in f for f in found)
    assert any("locale/stream symbols" in f for f in found)
    assert check_libstdcxx.problems(_library(tmp_path)) == []


@needs_binutils
@needs_gxx
def test_the_link_rule_keeps_libstdcxx_shared_under_a_static_flag(tmp_path):
    """What setup.py links with keeps libstdc++ shared even where -static-libstdc++ comes from
    LDFLAGS or the toolchain."""
    args = check_libstdcxx.link_args()
    assert args, "Linux builds get the link rule"
    assert check_libstdcxx.problems(_library(tmp_path, *args, "-static-libstdc++")) == []


def _relocated_libdir(tmp_path) -> str:
    """A library folder like a relocated toolchain's (a compiler copied under its own prefix, as on
    the GPU machine, where CXX is such a wrapper): libstdc++'s archive, and a libstdc++.so link
    that points nowhere."""
    libdir = tmp_path / "toolchain-lib"
    libdir.mkdir()
    archive = subprocess.run(
        ["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isfile(archive):
        pytest.skip("no libstdc++.a to model the relocated toolchain with")
    shutil.copy(archive, libdir / "libstdc++.a")
    os.symlink("../missing/libstdc++.so.6", libdir / "libstdc++.so")
    return str(libdir)


@needs_binutils
@needs_gxx
@pytest.mark.parametrize("by", ["loaded file", "soname"])
def test_the_link_rule_keeps_libstdcxx_shared_with_a_relocated_toolchain(tmp_path, monkeypatch, by):
    """A toolchain whose own library folder holds only libstdc++'s archive: ``-lstdc++`` takes the
    archive from there (the build that carried a copy of libstdc++ on the GPU machine); the link
    rule names the shared library's file and stays clean."""
    libdir = _relocated_libdir(tmp_path)
    plain = check_libstdcxx.problems(_library(tmp_path, "-L" + libdir, "-Wl,--no-as-needed", "-lstdc++"))
    assert plain and any("locale/stream symbols" in f for f in plain), "the model of the toolchain"
    if by == "soname":
        monkeypatch.setattr(check_libstdcxx, "loaded_libstdcxx", lambda: None)
    args = check_libstdcxx.link_args()
    assert ("-l:libstdc++.so.6" in args) == (by == "soname")
    assert check_libstdcxx.problems(_library(tmp_path, "-L" + libdir, *args, "-static-libstdc++")) == []


def test_the_loaded_libstdcxx_is_a_file_of_this_process():
    import torch  # noqa: F401  (torch's libstdc++ is loaded)

    path = check_libstdcxx.loaded_libstdcxx()
    if not sys.platform.startswith("linux"):
        assert path is None
        return
    assert path is not None and os.path.isfile(path) and "libstdc++.so" in os.path.basename(path)


def test_refused_calls_keep_their_numbers_call_after_call():
    """A refused call raises with the values it names, every time (the second refused call is the
    one that crashed with a copy of libstdc++ inside the extension)."""
    code = (
        "import torch, dilated_attention\n"
        "q = torch.randn(1, 8, 2, 257)\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        torch.ops.dilated_attention.fwd(q, q, q, [8], [1], False, 0.1, False, 0.0, 0, 0)\n"
        "    except RuntimeError as e:\n"
        "        print(str(e).splitlines()[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and all(
        line.endswith("head dim must be in [1, 256], got 257") for line in lines
    ), lines
