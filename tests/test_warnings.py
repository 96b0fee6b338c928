"""Every warning a user sees is a DilatedAttentionWarning and points at the user's own line.

The package warns only through ``dilated_attention._warnings.warn_once`` (one place that picks the
stack level of the first frame outside the package and torch, and keeps the once-per-cause rule).
The first test walks the package's source for any other ``warnings.warn``; the others set off
each kind of warning from this file, through the functional API and through modules (whose
``__call__`` adds torch frames), and check the category, the file and the line.
"""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import pytest
import torch

import dilated_attention as da
from dilated_attention import _warnings

PACKAGE = Path(da.__file__).resolve().parent


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            yield name, node


def test_the_package_warns_only_through_warn_once():
    direct, categories = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_warnings.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for name, node in _calls(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if name == "warn" and isinstance(node.func, ast.Attribute):
                direct.append(where)
            if name == "warn_once":
                category = node.args[2] if len(node.args) > 2 else None
                for kw in node.keywords:
                    if kw.arg == "category":
                        category = kw.value
                if category is not None and not isinstance(category, (ast.Name, ast.Attribute)):
                    categories.append(f"{where}: category is not a name")
                    continue
                cname = (
                    "DilatedAttentionWarning" if category is None else ast.unparse(category).split(".")[-1]
                )
                cls = getattr(_warnings, cname, None) or getattr(da, cname, None)
                if not (inspect.isclass(cls) and issubclass(cls, _warnings.DilatedAttentionWarning)):
                    categories.append(f"{where}: {cname}")
    assert not direct, f"warnings.warn outside dilated_attention._warnings (use warn_once): {direct}"
    assert not categories, f"warn_once with a category that is not a DilatedAttentionWarning: {categories}"


def test_every_category_is_exported_and_filterable():
    for name in _warnings.__all__:
        obj = getattr(_warnings, name)
        if inspect.isclass(obj):
            assert issubclass(obj, _warnings.DilatedAttentionWarning)
            assert getattr(da, name) is obj, f"dilated_attention.{name} is not exported"


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def _single(record: list[warnings.WarningMessage], category: type[Warning]) -> warnings.WarningMessage:
    mine = [w for w in record if issubclass(w.category, category)]
    assert mine, [str(w.message) for w in record]
    for w in record:  # nothing the package says escapes the class
        if "dilated_attention" in str(w.message):
            assert issubclass(w.category, _warnings.DilatedAttentionWarning), (w.category, str(w.message))
    return mine[0]


def test_functional_warnings_point_at_the_call():
    q = torch.randn(1, 16, 2, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        da.dilated_attention(q, q, q, [8], [4])  # uncovered
    w = _single(record, da.UncoveredPositionsWarning)
    assert (w.filename, w.lineno) == (__file__, _line_of("uncovered"))

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        da.dilated_attention(q, q, q, [8], [1], backend="flash_attn_2")  # fallback
    if any(issubclass(w.category, da.BackendFallbackWarning) for w in record):
        w = _single(record, da.BackendFallbackWarning)
        assert (w.filename, w.lineno) == (__file__, _line_of("fallback"))

    qt = torch.randn(1, 4, 256, 8)  # (B, H, N, D) given for (B, N, H, D)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        da.dilated_attention(qt, qt, qt, [4], [1])  # layout
    w = _single(record, da.LayoutWarning)
    assert (w.filename, w.lineno) == (__file__, _line_of("layout"))


def test_module_warnings_point_at_the_call():
    """Through nn.Module.__call__ (torch's frames) the warning still names this file's line."""
    attn = da.DilatedAttention([8], [4])
    q = torch.randn(1, 16, 2, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        attn(q, q, q)  # module-uncovered
    w = _single(record, da.UncoveredPositionsWarning)
    assert (w.filename, w.lineno) == (__file__, _line_of("module-uncovered"))


def test_the_documented_filter_silences_them():
    q = torch.randn(1, 16, 2, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", da.DilatedAttentionWarning)
        da.dilated_attention(q, q, q, [8], [4])
        da.DilatedAttention([8], [4])(q, q, q)
    assert not record, [str(w.message) for w in record]


@pytest.mark.parametrize("n", [1, 2])
def test_once_per_cause(n):
    q = torch.randn(1, 16, 2, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(n + 1):
            da.dilated_attention(q, q, q, [8], [4])
    assert len([w for w in record if issubclass(w.category, da.UncoveredPositionsWarning)]) == 1
