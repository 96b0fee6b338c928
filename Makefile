# Commands of the README. `make help` lists them.
PYTHON ?= python3
# torch with CUDA support compiles and links the CUDA kernels even on a machine without a GPU.
TORCH_SPEC ?= torch==2.14.1
# The tested range of the optional extra `transformers` (pyproject.toml), so that its tests run.
TRANSFORMERS_SPEC ?= transformers>=5.23,<5.24

.PHONY: help deps install lint format test test-slow train bench cuda-check gpu-check clean

help:
	@echo "make install     build and install the package (editable) into the current Python"
	@echo "make lint        check formatting and lint (ruff, clang-format), changing nothing"
	@echo "make format      format the Python and C/C++/CUDA sources in place"
	@echo "make test        run the test suite"
	@echo "make train       train the example GPT on the bundled corpus, then sample from it"
	@echo "make bench       CPU benchmark of every backend against the alternatives"
	@echo "make cuda-check  compile the CUDA kernels, and check they assemble for sm_60/61 (no GPU needed)"
	@echo "make gpu-check   verify the CUDA kernels on this machine's GPU (scripts/gpu_check.sh)"

deps:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q "setuptools>=64" wheel ninja tqdm numpy pytest expecttest matplotlib
	$(PYTHON) -m pip install -q "$(TRANSFORMERS_SPEC)"

# The formatters' versions are pinned: another version may format the same code differently.
LINT_TOOLS ?= ruff==0.17.6 clang-format==23.1.5
C_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh')

install: deps
	$(PYTHON) -m pip install -q --no-build-isolation -e .

lint:
	$(PYTHON) -m pip install -q $(LINT_TOOLS)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	clang-format --dry-run --Werror $(C_SOURCES)

format:
	$(PYTHON) -m pip install -q $(LINT_TOOLS)
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	clang-format -i $(C_SOURCES)

test:
	$(PYTHON) -m pytest -q

test-slow:
	DILATED_ATTENTION_SLOW=1 $(PYTHON) -m pytest -q

train:
	$(PYTHON) examples/gpt/train.py examples/gpt/config/train_stdlib.py
	$(PYTHON) examples/gpt/sample.py --start="def " --num_samples=1 --max_new_tokens=500

bench:
	$(PYTHON) benchmarks/bench.py

# The sm_60/61 check fetches a CUDA 12 ptxas once (the nvidia-cuda-nvcc-cu12 wheel, with pip).
cuda-check:
	bash scripts/check_cuda_build.sh
	bash scripts/check_simt_sm60.sh

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build dilated_attention/_C*.so *.egg-info
