# Commands of the README. `make help` lists them.
PYTHON ?= python3
# torch with CUDA support compiles and links the CUDA kernels even on a machine without a GPU.
TORCH_SPEC ?= torch==2.14.1

.PHONY: help deps install lint format test test-slow train longcontext bench cuda-check clean

help:
	@echo "make install     build and install the package (editable) into the current Python"
	@echo "make lint        check formatting and lint (ruff, clang-format), changing nothing"
	@echo "make format      format the Python and C/C++/CUDA sources in place"
	@echo "make test        run the test suite"
	@echo "make train       train the example GPT on the bundled corpus, then sample from it"
	@echo "make longcontext  train the recall task with dilated, local and dense attention; table and plot"
	@echo "make bench       CPU benchmark of every backend against the alternatives"
	@echo "make cuda-check  compile the CUDA kernels (no GPU needed)"

deps:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q "setuptools>=64" wheel ninja tqdm numpy pytest expecttest matplotlib

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

# Three 10-minute trainings on a CPU; results in examples/gpt/out-longcontext/.
longcontext:
	$(PYTHON) examples/gpt/longcontext.py examples/gpt/config/recall.py

bench:
	$(PYTHON) benchmarks/bench.py

cuda-check:
	bash scripts/check_cuda_build.sh

clean:
	rm -rf build dilated_attention/_C*.so *.egg-info
