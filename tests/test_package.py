"""The package as a user meets it: without the compiled extension, its warnings, its sdist, its types."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import textwrap
import warnings

import pytest
import torch
from common import make_inputs

import dilated_attention as da
from dilated_attention import LayoutWarning, UncoveredPositionsWarning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run before `import dilated_attention`: makes the import of the compiled extension fail the way an
# unbuilt checkout (ModuleNotFoundError) or a build for another torch (ImportError: undefined
# symbol) makes it fail.
_BLOCK_EXTENSION = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "dilated_attention._C":
            if {mode!r} == "missing":
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            raise ImportError(name + ".so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")
sys.meta_path.insert(0, _Block())
"""


def _run_without_extension(mode: str, body: str) -> subprocess.CompletedProcess:
    script = _BLOCK_EXTENSION.format(mode=mode) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "tests")}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


@pytest.mark.parametrize("mode", ["missing", "mismatched"])
def test_without_the_extension_every_backend_says_why(mode):
    """The extension holds native's kernels and the plan of the other backends' calls: without it
    no backend is chosen, a call raises naming it and what to run; the report still runs."""
    run = _run_without_extension(
        mode,
        """
        import warnings
        import torch
        import dilated_attention as da
        from dilated_attention.backends import BackendRequest, get_backend
        q = torch.randn(1, 24, 2, 8, dtype=torch.float64)
        for backend in ("auto", "sdpa", "manual"):
            try:
                da.dilated_attention(q, q, q, [8, 16], [1, 2], backend=backend)
            except RuntimeError as exc:
                print("CALL:", backend, str(exc).replace("\\n", " "))
        print("CACHE:", da.get_pattern_cache().info())
        why = get_backend("native").reasons(BackendRequest(torch.device("cpu"), torch.float32, 8))
        print("NATIVE:", why)
        try:
            da.op.native_forward(q, q, q, [8], [1], False, 1.0)
        except RuntimeError as exc:
            print("RAISES:", exc)
        from dilated_attention.__main__ import main
        main([])
        """,
    )
    assert run.returncode == 0, run.stderr
    out, err = run.stdout, run.stderr
    # One warning at import, naming what happened and what to run; it points at the user's import.
    assert err.count("ExtensionWarning") == 1, err
    assert "pip install --no-build-isolation -e ." in err and "<string>" in err
    if mode == "missing":
        assert "is not built" in err and "unbuilt source checkout" in err
    else:
        assert "failed to load" in err and "undefined symbol" in err and torch.__version__ in err
    assert "circular import" not in out + err
    for backend in ("auto", "sdpa", "manual"):
        line = next(x for x in out.splitlines() if x.startswith(f"CALL: {backend} "))
        assert "the compiled extension dilated_attention._C" in line, line
        assert "pip install --no-build-isolation -e ." in line, line
    assert "CACHE: CacheInfo(hits=0, misses=0, entries=0, max_entries=0)" in out
    assert 'NATIVE: ["the compiled extension dilated_attention._C' in out
    assert "RAISES: dilated_attention: the compiled extension" in out
    assert "extension        not loaded:" in out


def test_uncovered_positions_warn_once_and_only_when_some_position_has_no_head():
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32, requires_grad=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        da.dilated_attention(q, k, v, [4, 8], [1, 4])  # r = 1 covers everything
        da.dilated_attention(q, k, v, [8], [2])  # r <= H: every position has a head
        assert not [w for w in seen if w.category is UncoveredPositionsWarning]
        for _ in range(3):
            out = da.dilated_attention(q, k, v, [8, 16], [4, 8])  # every r > H = 2
    (w,) = [w for w in seen if w.category is UncoveredPositionsWarning]
    assert "every dilation rate ([4, 8]) exceeds the number of query heads (2)" in str(w.message)
    assert w.filename == __file__
    # The warning is true: position H = 2 has output 0 in every head.
    assert out[0, 2].abs().max().item() == 0.0


def test_transposed_layout_warns_once_with_the_fix():
    q = torch.randn(1, 4, 160, 8)  # (B, H, N, D) passed as (B, N, H, D): "160 heads"
    with pytest.warns(LayoutWarning, match=r"pass q.transpose\(1, 2\)") as seen:
        da.dilated_attention(q, q, q, [32], [1])
        da.dilated_attention(q, q, q, [32], [1])
    assert len([w for w in seen if w.category is LayoutWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)
        da.dilated_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), [32], [1])
        small = torch.randn(1, 4, 8, 8)  # a short sequence with 8 heads is plausible
        da.dilated_attention(small, small, small, [4], [1])


def test_warnings_can_be_silenced_by_their_base_class():
    q = torch.randn(1, 16, 2, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", da.DilatedAttentionWarning)
        da.dilated_attention(q, q, q, [8], [4], backend="flash_attn_2")
    assert not seen


def test_files_stay_short_enough_to_read():
    """No Python file of the package over 400 lines, no hand-written C++/CUDA file over 1,000
    (the generated kernel instances aside): a file past that holds more than one job."""
    long = []
    for path in glob.glob(os.path.join(ROOT, "dilated_attention", "**", "*.py"), recursive=True):
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > 400:
            long.append((os.path.relpath(path, ROOT), n))
    for ext in ("cpp", "h", "cu", "cuh"):
        for path in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True):
            with open(path) as f:
                text = f.read()
            n = text.count("\n")
            if n > 1000 and not text.startswith("// Generated by"):
                long.append((os.path.relpath(path, ROOT), n))
    assert not long, long


def test_sdist_carries_every_source_and_header(tmp_path):
    """The source distribution holds every C/C++/CUDA file git tracks under csrc/ (the build of
    an sdist without its headers fails), the license, the changelog and py.typed."""
    pytest.importorskip("build")
    tracked = subprocess.run(
        ["git", "ls-files", "csrc"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if tracked.returncode != 0 or not tracked.stdout:
        pytest.skip("not a git checkout")
    run = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path), ROOT],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DILATED_ATTENTION_CPU_ONLY": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (sdist,) = tmp_path.glob("dilated_attention-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = set(tracked.stdout.split()) - names
    assert not missing, f"the sdist lacks {sorted(missing)}"
    for name in ("LICENSE", "CHANGELOG.md", "dilated_attention/py.typed", "setup.py", "pyproject.toml"):
        assert name in names
    assert not [n for n in names if n.endswith(".so")]


def test_wgmma_ptx_matches_its_generator():
    """csrc/cuda/wgmma_ops.cuh is what scripts/generate_wgmma.py writes, and names every
    accumulator register of each shape once."""
    script = os.path.join(ROOT, "scripts", "generate_wgmma.py")
    run = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(os.path.join(ROOT, "csrc", "cuda", "wgmma_ops.cuh"), encoding="utf-8") as f:
        text = f.read()
    # (N, forms): 16 the products of two tiles only, 64 both, 256 those with probabilities only.
    for n, forms in ((16, ("ss",)), (64, ("ss", "rs")), (256, ("rs",))):
        block = text[text.index(f"struct WgmmaPtx<__nv_bfloat16, {n}>") :]
        block = block[: block.index("};")]
        assert block.count(f"m64n{n}k16.f32.bf16.bf16") == len(forms)
        assert block.count('"+f"(d[') == len(forms) * (n // 2)  # every accumulator, once per form
        assert all(f"static void {f}(" in block for f in forms) and block.count("static void") == len(forms)
        assert f"%{n // 2 - 1}}}" in block and f"%{n // 2}}}" not in block


def test_tensor_core_instance_files_match_their_generator(tmp_path):
    """csrc/cuda/tc/ holds what scripts/generate_tc_instances.py writes (one file per instantiation
    of the tensor-core launchers), and its --check fails on a changed, missing or stray file."""
    script = os.path.join(ROOT, "scripts", "generate_tc_instances.py")
    run = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr

    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_tc_instances", script)
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    files = gen.instances()
    assert len(files) == 6 * 2 * 6 and "dkv_bf16_d128.cu" in files
    assert "template TcConfig tc_dkv_dp<__nv_bfloat16, 128>(" in files["dkv_bf16_d128.cu"]
    out = tmp_path / "tc"
    gen.write(str(out))
    assert gen.differences(str(out)) == []
    (out / "fwd_f16_d32.cu").write_text("// edited\n")
    (out / "dq_bf16_d64.cu").unlink()
    (out / "fwd_f16_d48.cu").write_text("")
    found = gen.differences(str(out))
    assert len(found) == 3, found
    assert [line.split(":")[0] for line in found] == ["differs", "missing", "not generated"], found


def test_return_lse_overloads_return_what_they_declare():
    """mypy checks the declared types (tests/typing/check_types.py, run by `make typecheck`); here,
    that at run time the calls return what the overloads say."""
    q = torch.randn(1, 8, 2, 4)
    assert isinstance(da.dilated_attention(q, q, q, [4], [1]), torch.Tensor)
    assert isinstance(da.dilated_attention(q, q, q, [4], [1], return_lse=False), torch.Tensor)
    pair = da.dilated_attention(q, q, q, [4], [1], return_lse=True)
    assert isinstance(pair, tuple) and len(pair) == 2 and pair[1].shape == (1, 2, 8)
    assert os.path.exists(os.path.join(ROOT, "dilated_attention", "py.typed"))


def test_extension_built_for_another_torch_warns(monkeypatch):
    """setup.py records the torch it built against (_build_info.json); another torch at run time
    gives an ExtensionWarning that names both and what to run."""
    from dilated_attention import ExtensionWarning
    from dilated_attention.op import library as _ops

    monkeypatch.setattr(_ops, "_build_info", lambda module: {"torch": "2.0.0+cu118", "cuda": "11.8"})
    with pytest.warns(ExtensionWarning, match=r"built against torch 2\.0\.0\+cu118 \(CUDA 11\.8\)") as seen:
        module, error = _ops._load_extension()
    assert module is not None and error is None  # it loaded: native stays usable
    assert f"runs with torch {torch.__version__}" in str(seen[0].message)
    assert "pip install --no-build-isolation -e ." in str(seen[0].message)
    monkeypatch.setattr(_ops, "_build_info", lambda module: {"torch": torch.__version__, "cuda": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtensionWarning)
        _ops._load_extension()


def test_build_info_is_read_beside_the_extension(tmp_path):
    from dilated_attention.op import library as _ops

    fake = type(sys)("fake")
    fake.__file__ = str(tmp_path / "_C.so")
    assert _ops._build_info(fake) is None
    (tmp_path / "_build_info.json").write_text('{"torch": "9.9", "cuda": null, "python": "3.11"}')
    assert _ops._build_info(fake) == {"torch": "9.9", "cuda": None, "python": "3.11"}
    (tmp_path / "_build_info.json").write_text("not json")
    assert _ops._build_info(fake) is None


# ----------------------------------------------------------------------------------------------
# setup.py: which CUDA architectures a build compiles
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def setup_py(monkeypatch, capsys):
    """setup.py's functions, loaded with setuptools.setup stubbed out (nothing is built)."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    for name in ("TORCH_CUDA_ARCH_LIST", "FORCE_CUDA", "DILATED_ATTENTION_CPU_ONLY"):
        monkeypatch.setenv(name, "")  # restored (or removed) after the test, whatever setup.py sets
        monkeypatch.delenv(name)
    monkeypatch.chdir(ROOT)
    ns = runpy.run_path(os.path.join(ROOT, "setup.py"))
    capsys.readouterr()
    return ns


def _fake_gpus(monkeypatch, caps):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i or 0])


def test_setup_builds_for_the_visible_gpus_else_the_cpu_only(setup_py, monkeypatch):
    """PyTorch's convention: TORCH_CUDA_ARCH_LIST, else the visible GPUs, else (no GPU) the CPU
    kernels only unless FORCE_CUDA=1 (every architecture, as for a wheel)."""
    if setup_py["CUDA_HOME"] is None or torch.version.cuda is None:
        pytest.skip("needs nvcc and a CUDA-enabled torch")
    plan = setup_py["_cuda_plan"]
    everything = setup_py["_default_arch_list"]()
    _fake_gpus(monkeypatch, [])
    assert plan() == (None, "no GPU visible")
    message = setup_py["cpu_only_message"]("no GPU visible")
    assert "CPU kernels only (no GPU visible)" in message and "FORCE_CUDA=1" in message
    assert "TORCH_CUDA_ARCH_LIST" in message and everything in message
    monkeypatch.setenv("FORCE_CUDA", "1")
    assert plan() == (everything, "FORCE_CUDA=1, every architecture")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert plan() == ("8.0", "TORCH_CUDA_ARCH_LIST")
    monkeypatch.delenv("FORCE_CUDA")
    assert plan() == ("8.0", "TORCH_CUDA_ARCH_LIST")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    _fake_gpus(monkeypatch, [(9, 0)])
    assert plan() == ("9.0+PTX", "the visible GPUs")
    _fake_gpus(monkeypatch, [(9, 0), (8, 6), (9, 0)])
    assert plan() == ("8.6;9.0+PTX", "the visible GPUs")
    monkeypatch.setenv("FORCE_CUDA", "1")  # visible GPUs still decide: FORCE_CUDA only forces a CUDA build
    assert plan() == ("8.6;9.0+PTX", "the visible GPUs")
    # DILATED_ATTENTION_CPU_ONLY=1 wins over everything.
    monkeypatch.setenv("DILATED_ATTENTION_CPU_ONLY", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert plan() == (None, "DILATED_ATTENTION_CPU_ONLY=1")
    assert "CPU kernels only (DILATED_ATTENTION_CPU_ONLY=1)" in setup_py["cpu_only_message"](
        "DILATED_ATTENTION_CPU_ONLY=1"
    )


def test_setup_compiles_sm90_as_sm90a(setup_py):
    """The sm90 kernels' wgmma exists only in sm_90a code: 9.0 is built as 9.0a (which every
    compute capability 9.0 GPU runs), a 9.0 PTX stays compute_90 (newer GPUs JIT it), other
    architectures are left alone."""
    sm90a = setup_py["_sm90a"]
    assert sm90a("9.0") == ("9.0a", [])
    assert sm90a("7.5;8.0;8.6;8.9;9.0+PTX") == (
        "7.5;8.0;8.6;8.9;9.0a",
        ["-gencode=arch=compute_90,code=compute_90"],
    )
    assert sm90a("8.0 8.6+PTX") == ("8.0;8.6+PTX", [])
    assert sm90a("9.0;9.0a") == ("9.0a", [])


def test_setup_says_what_it_builds(setup_py, monkeypatch, capsys):
    _fake_gpus(monkeypatch, [])
    ext = setup_py["_extension"]()
    out = capsys.readouterr().out
    if setup_py["CUDA_HOME"] is not None and torch.version.cuda is not None:
        assert out.strip() == "dilated_attention: " + setup_py["cpu_only_message"]("no GPU visible")
    assert ext.name == "dilated_attention._C" and not any(s.endswith(".cu") for s in ext.sources)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    if setup_py["CUDA_HOME"] is None or torch.version.cuda is None:
        return
    ext = setup_py["_extension"]()
    assert "for TORCH_CUDA_ARCH_LIST=8.0 (TORCH_CUDA_ARCH_LIST)" in capsys.readouterr().out
    # Every CUDA source is compiled, the tensor-core instances of csrc/cuda/tc/ included.
    cuda_files = {
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(ROOT, "csrc", "cuda", "**", "*.cu"), recursive=True)
    }
    assert any(f.startswith(os.path.join("csrc", "cuda", "tc", "")) for f in cuda_files)
    assert cuda_files <= set(ext.sources), sorted(cuda_files - set(ext.sources))


def _makefile_define(name: str) -> str:
    import re

    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    m = re.search(rf"^define {name}\n(.*?)^endef$", text, re.MULTILINE | re.DOTALL)
    assert m, f"no define {name} in the Makefile"
    return m.group(1)


def test_dist_check_venv_sees_the_torch_of_an_outer_virtual_environment(tmp_path):
    """make dist-check inside a virtual environment: the nested --system-site-packages venv reaches
    only the base interpreter's packages, not the outer venv's torch; DIST_OUTER_PATHS adds the
    outer interpreter's package folders (not the checkout). The outer venv here is made from an
    interpreter without torch, its torch reached through a .pth file."""
    import shutil

    torch_site = os.path.dirname(os.path.dirname(torch.__file__))
    base = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/bin:/usr/local/bin")
    if base is None or os.path.realpath(base) == os.path.realpath(sys.executable):
        pytest.skip("needs a second interpreter of this Python version (the outer venv's base)")
    if subprocess.run([base, "-c", "import torch"], capture_output=True, timeout=120).returncode == 0:
        pytest.skip(f"{base} has torch itself: the failure cannot be reproduced with it")

    def python(venv):
        return os.path.join(venv, "bin", "python")

    def purelib(venv):
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        return subprocess.check_output([python(venv), "-c", code], text=True).strip()

    outer, inner = str(tmp_path / "outer"), str(tmp_path / "inner")
    subprocess.run([base, "-m", "venv", "--without-pip", outer], check=True, timeout=120)
    with open(os.path.join(purelib(outer), "torch_here.pth"), "w") as f:
        f.write(torch_site + "\n")
    subprocess.run(
        [python(outer), "-m", "venv", "--system-site-packages", "--without-pip", inner],
        check=True,
        timeout=120,
    )
    probe = "import torch, sys; print(torch.__version__)"
    before = subprocess.run(
        [python(inner), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert before.returncode != 0 and "No module named 'torch'" in before.stderr  # the failure itself
    res = subprocess.run(
        [python(outer), "-c", _makefile_define("DIST_OUTER_PATHS"), inner],
        capture_output=True,
        text=True,
        cwd=ROOT,  # as make runs it: from the checkout, which must not be added
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    after = subprocess.run(
        [python(inner), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert after.returncode == 0 and after.stdout.strip() == torch.__version__, after.stderr
    with open(os.path.join(purelib(inner), "_outer_env.pth")) as f:
        added = f.read().split()
    assert torch_site in added and not any(os.path.isdir(os.path.join(p, "dilated_attention")) for p in added)


@pytest.mark.parametrize(
    "info,says",
    [
        (
            {"cuda_arch_list": None, "cuda_arch_reason": "no GPU visible"},
            "CPU kernels only (no GPU visible); for the CUDA kernels: TORCH_CUDA_ARCH_LIST=",
        ),
        (
            {"cuda_arch_list": "9.0+PTX", "cuda_arch_reason": "the visible GPUs"},
            "CUDA kernels for 9.0+PTX (the visible GPUs)",
        ),
        (
            {"cuda_arch_list": None, "cuda_arch_reason": "DILATED_ATTENTION_CPU_ONLY=1"},
            "CPU kernels only (DILATED_ATTENTION_CPU_ONLY=1)",
        ),
        (None, "CPU kernels only (unknown)"),
    ],
)
def test_make_install_says_what_it_built(tmp_path, info, says):
    import json

    (tmp_path / "dilated_attention").mkdir()
    if info is not None:
        (tmp_path / "dilated_attention" / "_build_info.json").write_text(json.dumps(info))
    res = subprocess.run(
        [sys.executable, "-c", _makefile_define("BUILT_REPORT")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert res.returncode == 0 and says in res.stdout and res.stdout.count("\n") == 1, res.stdout + res.stderr
