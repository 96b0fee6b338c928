"""Every fenced Python block of the README and docs/ runs as pasted, on its own, on the CPU.

Each block is executed in a fresh namespace, so a block that uses a name defined by the block
before it fails here with the NameError a reader would get. A block that cannot run on one CPU
process (it needs a GPU, or several processes under torchrun) says so on the line before its
fence, as ``<!-- docs-test: skip REASON -->``, and is only compiled.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(.+?)\s*-->\s*$")


def _blocks() -> list:
    params = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            name = f"{path.relative_to(ROOT)}:{line}"
            params.append(pytest.param(name, m.group(1), skip.group(1) if skip else None, id=name))
    return params


BLOCKS = _blocks()


def test_the_docs_have_python_blocks():
    """The collection itself works: a regular expression that matched nothing would pass vacuously."""
    assert len(BLOCKS) >= 10, [p.id for p in BLOCKS]


@pytest.mark.parametrize(("name", "code", "skip"), BLOCKS)
def test_python_block_runs_on_its_own(name: str, code: str, skip: str | None):
    compiled = compile(code, name, "exec")  # every block is Python, skipped or not
    if skip is not None:
        pytest.skip(skip)
    if (
        re.search(r"^\s*(from|import) transformers\b", code, re.MULTILINE)
        or "dilated_attention.transformers" in code
    ):
        if importlib.util.find_spec("transformers") is None:
            pytest.skip("needs the optional extra transformers")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the blocks show warnings on purpose (fallbacks)
            # but not a deprecated argument of a library (transformers' generate(past_key_values=)):
            # a pasted block should not warn that it is out of date
            warnings.filterwarnings("error", message=r".*\bdeprecated\b", category=FutureWarning)
            exec(compiled, {"__name__": "__docs__"})
    finally:
        torch.set_num_threads(threads)
