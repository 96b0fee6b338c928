# Commands of the README. `make help` lists them.
PYTHON ?= python3
# torch with CUDA support compiles and links the CUDA kernels even on a machine without a GPU.
TORCH_SPEC ?= torch==2.14.1
# The tested range of the optional extra `transformers` (pyproject.toml), so that its tests run.
TRANSFORMERS_SPEC ?= transformers>=5.0,<5.25

.PHONY: help deps install lint typecheck format test test-slow train longcontext bench cuda-check gpu-check gpu-session sm90-first-run dist dist-check clean

help:
	@echo "make help        this list"
	@echo "make deps        install the dependencies only ($(TORCH_SPEC), transformers, matplotlib, pytest, build tools)"
	@echo "make install     install $(TORCH_SPEC), transformers, matplotlib and pytest, then build and install the package (editable) into the current Python"
	@echo "make lint        check formatting, lint and types (ruff, clang-format, mypy), changing nothing"
	@echo "make typecheck   type-check the package (mypy)"
	@echo "make format      format the Python and C/C++/CUDA sources in place"
	@echo "make test        run the test suite (the long sweeps and slow compile cases: make test-slow)"
	@echo "make train       train the example GPT on a corpus made from this machine's Python standard library sources, then sample from it"
	@echo "make longcontext  train the recall task with dilated, local and dense attention; table and plot"
	@echo "make bench       CPU benchmark of every backend against the alternatives"
	@echo "make cuda-check  compile the CUDA kernels, the sm90 ones for sm_90a, and check they assemble for sm_60/61 (no GPU needed)"
	@echo "make gpu-check   verify the CUDA kernels on this machine's GPU (scripts/gpu_check.sh tests, then sanitize)"
	@echo "make gpu-session one GPU command (< 10 min): build, attention alone and the GPT (16K-128K) vs dense, a profiled step, then the tests"
	@echo "make sm90-first-run  the Hopper (wgmma) kernels' first run (< 10 min): registers, smoke under a hard kill, TMA off on failure, speed, profile"
	@echo "make dist        build the source distribution and a wheel into dist/"
	@echo "make dist-check  build the sdist, build a wheel from it in a fresh venv, install it there and import it"
	@echo "make clean       remove the build outputs (build/, dist/, the compiled extension)"

# One pip call (one resolution: each call costs seconds even when everything is installed). Not
# quiet: in a fresh environment it downloads gigabytes, and pip's progress is the only sign of life.
deps:
	@echo "make install: installing $(TORCH_SPEC) (the CUDA build: about 5.7 GB installed in a fresh" \
		"environment, minutes to download), $(TRANSFORMERS_SPEC), matplotlib, pytest and the build tools"
	$(PYTHON) scripts/progress.py "make install (pip)" -- $(PYTHON) -m pip install "$(TORCH_SPEC)" \
		"setuptools>=77" wheel ninja build tqdm numpy pytest expecttest matplotlib "$(TRANSFORMERS_SPEC)"

# The formatters' versions are pinned: another version may format the same code differently.
LINT_TOOLS ?= ruff==0.17.6 clang-format==23.1.5
# The type checker's version is pinned too: a new mypy release may find new errors in the same code.
TYPECHECK_TOOLS ?= mypy==2.4.1
C_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cuda_emulation/*.cpp' 'tests/cuda_emulation/*.h')

# Without a GPU (and without TORCH_CUDA_ARCH_LIST or FORCE_CUDA=1) this builds the CPU kernels only
# (setup.py); the last line says what was built and how to get the rest.
install: deps
	@echo "make install: compiling the kernels (a minute or two for the CPU kernels on a quiet machine; longer" \
		"with the CUDA kernels), one line per source file; the whole output goes to build/install.log"
	@mkdir -p build
	$(PYTHON) scripts/progress.py "make install" --compile --log build/install.log -- \
		$(PYTHON) -m pip install -v --no-build-isolation -e .
	@$(PYTHON) -c "$$BUILT_REPORT"

lint:
	$(PYTHON) -m pip install -q $(LINT_TOOLS)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	clang-format --dry-run --Werror $(C_SOURCES)
	$(MAKE) --no-print-directory typecheck

typecheck:
	$(PYTHON) -m pip install -q $(TYPECHECK_TOOLS)
	$(PYTHON) -m mypy

format:
	$(PYTHON) -m pip install -q $(LINT_TOOLS)
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	clang-format -i $(C_SOURCES)

test:
	@echo "make test: importing torch and collecting the tests (seconds on a quiet machine), then a dot per test"
	$(PYTHON) -m pytest -q

test-slow:
	DILATED_ATTENTION_SLOW=1 $(PYTHON) -m pytest -q

train:
	$(PYTHON) examples/gpt/train.py examples/gpt/config/train_stdlib.py
	$(PYTHON) examples/gpt/sample.py --start="def " --num_samples=1 --max_new_tokens=500

# Three 10-minute trainings on a CPU; results in examples/gpt/out-longcontext/.
longcontext:
	$(PYTHON) examples/gpt/longcontext.py examples/gpt/config/recall.py

bench:
	$(PYTHON) benchmarks/bench.py

# Every architecture's CUDA kernels compile whatever `make install` built here. The sm_60/61 check
# fetches a CUDA 12 ptxas once (the nvidia-cuda-nvcc-cu12 wheel, with pip). check_cxx17.sh: the
# sources stay C++17 (torch 2.11 builds extensions as C++17, newer torch as C++20).
cuda-check:
	bash scripts/check_cuda_build.sh
	bash scripts/check_sm90a.sh
	bash scripts/check_simt_sm60.sh
	bash scripts/check_cxx17.sh

# Both commands of the GPU check (each under 8 minutes on an H100), each into its own folder.
GPU_CHECK_OUT ?= gpu_check_out
gpu-check:
	bash scripts/gpu_check.sh tests $(GPU_CHECK_OUT)/tests; rc=$$?; \
		bash scripts/gpu_check.sh sanitize $(GPU_CHECK_OUT)/sanitize && exit $$rc

# One command on a GPU machine, under 10 minutes: measurements first (the attention alone and the example GPT at 16K-128K against dense attention, a
# profiled step), then the views driver's and the kernels' GPU tests (scripts/gpu_session.sh).
GPU_SESSION_OUT ?= gpu_session_out
gpu-session:
	bash scripts/gpu_session.sh $(GPU_SESSION_OUT)

# The first run of the sm90 (wgmma) kernels on an H100/H200: hang, wrong or slow, said at a glance.
SM90_FIRST_RUN_OUT ?= sm90_first_run_out
sm90-first-run:
	bash scripts/sm90_first_run.sh $(SM90_FIRST_RUN_OUT)

# The sdist and a wheel, built against the torch installed here (no download of another torch).
dist:
	rm -rf dist
	$(PYTHON) -m build --sdist --wheel --no-isolation --outdir dist .

# What a user of the source distribution does: a fresh virtual environment that sees the installed
# torch, a wheel built from the sdist alone (pip unpacks it elsewhere, so a file the sdist lacks
# fails the build), installed there and imported from outside the checkout. The new environment
# sees what $(PYTHON) sees: --system-site-packages for the base interpreter's packages, and a .pth
# file listing $(PYTHON)'s own package folders, where torch is when $(PYTHON) is itself a virtual
# environment (the README's setup; --system-site-packages alone would not reach them).
# CPU kernels only (DILATED_ATTENTION_CPU_ONLY=1) so that the kernels compile once, in a minute or two.
DIST_VENV ?= build/dist-venv
# The lines of a source build that say nothing a person needs (the whole output is in build/*.log).
BUILD_NOISE = ^(copying |adding |creating |hard linking |writing |reading |running |removing |Copying |x |not copying |warning: no previously-included|listing git files)
dist-check:
	rm -rf dist $(DIST_VENV)
	@mkdir -p build
	$(PYTHON) scripts/progress.py "make dist-check" --log build/dist-sdist.log --hide "$(BUILD_NOISE)" -- \
		$(PYTHON) -m build --sdist --no-isolation --outdir dist .
	$(PYTHON) -m venv --system-site-packages --without-pip $(DIST_VENV)
	$(PYTHON) -c "$$DIST_OUTER_PATHS" $(DIST_VENV)
	DILATED_ATTENTION_CPU_ONLY=1 $(PYTHON) scripts/progress.py "make dist-check (wheel)" --compile \
		--log build/dist-wheel.log -- $(DIST_VENV)/bin/python -m pip wheel -v --no-build-isolation --no-deps \
		--wheel-dir dist dist/dilated_attention-*.tar.gz
	$(DIST_VENV)/bin/python -m pip install -q --no-deps --no-index dist/dilated_attention-*.whl
	cd $(DIST_VENV) && bin/python -c "$$DIST_SMOKE_TEST"

# Writes DIST_VENV/.../site-packages/_outer_env.pth: the folders on $(PYTHON)'s sys.path that hold
# packages (site-packages, dist-packages, or folders that .pth files added), but none that holds
# dilated_attention itself (the checkout), so that the copy installed in DIST_VENV is imported.
define DIST_OUTER_PATHS
import os, subprocess, sys, sysconfig
venv = sys.argv[1]
inner = subprocess.check_output([os.path.join(venv, 'bin', 'python'), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'], text=True).strip()
stdlib = os.path.realpath(sysconfig.get_paths()['stdlib'])
def wanted(p):
    real = os.path.realpath(p)
    if not p or not os.path.isdir(p) or real == os.path.realpath(os.getcwd()):
        return False
    if (real == stdlib or real.startswith(stdlib + os.sep)) and 'packages' not in real:
        return False  # the standard library (and lib-dynload): the new environment has its own
    return not os.path.exists(os.path.join(p, 'dilated_attention'))
keep = [p for i, p in enumerate(sys.path) if wanted(p) and p not in sys.path[:i]]
with open(os.path.join(inner, '_outer_env.pth'), 'w') as f:
    f.write(''.join(p + '\n' for p in keep))
print('dist-check: the new environment also sees', ', '.join(keep) or 'nothing more')
endef
export DIST_OUTER_PATHS

define BUILT_REPORT
import json
try:
    info = json.load(open('dilated_attention/_build_info.json'))
except (OSError, ValueError):
    info = {}
archs, why = info.get('cuda_arch_list'), info.get('cuda_arch_reason', 'unknown')
if archs:
    print(f'dilated_attention: built the CPU kernels and the CUDA kernels for {archs} ({why})')
elif why == 'no GPU visible':
    print('dilated_attention: built the CPU kernels only (no GPU visible); for the CUDA kernels: '
          'TORCH_CUDA_ARCH_LIST="9.0" make install (your GPU: 9.0 for H100/H200, 8.0 A100, 8.9 L4/RTX 40xx), '
          'or FORCE_CUDA=1 make install (every architecture, slow)')
else:
    print(f'dilated_attention: built the CPU kernels only ({why})')
endef
export BUILT_REPORT

define DIST_SMOKE_TEST
import os, sys, warnings, torch
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter('always')
    import dilated_attention as da
assert da.__file__.startswith(sys.prefix), f'imported {da.__file__}, not the copy installed in {sys.prefix}'
assert not [w for w in seen if issubclass(w.category, da.DilatedAttentionWarning)], [str(w.message) for w in seen]
assert da.op.has_kernel('cpu'), 'the installed extension has no CPU kernels'
assert os.path.exists(os.path.join(os.path.dirname(da.__file__), '_build_info.json')), 'no _build_info.json'
assert os.path.exists(os.path.join(os.path.dirname(da.__file__), 'py.typed')), 'no py.typed'
assert os.path.exists(os.path.join(os.path.dirname(da.__file__), 'gpu_records.json')), 'no gpu_records.json'
q = torch.randn(1, 64, 2, 16)
out = da.dilated_attention(q, q, q, [16, 32], [1, 2], backend='native')
print('installed', da.__version__, 'from', da.__file__, '- native forward ok:', tuple(out.shape))
endef
export DIST_SMOKE_TEST

clean:
	rm -rf build dist dilated_attention/_C*.so dilated_attention/_build_info.json *.egg-info
