"""TorchScript (``torch.jit.script``) is refused by name, before it fails on the modules' Python.

The modules choose their backend at run time, in Python (:mod:`dilated_attention.backends`), and
hold objects TorchScript has no type for, so scripting them fails deep inside the compiler with
messages such as "Unknown type annotation". ``torch.jit.script`` calls ``__prepare_scriptable__``
on a module and on every submodule before compiling it, so a model that merely contains one of
these modules gets the same clear error.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["NotScriptable"]


class NotScriptable:
    """Mixin of the ``nn.Module`` classes that ``torch.jit.script`` cannot compile."""

    def __prepare_scriptable__(self) -> NoReturn:
        """Called by ``torch.jit.script``: raises a RuntimeError that names it and the alternatives."""
        name = type(self).__name__
        raise RuntimeError(
            f"dilated_attention: {name} cannot be compiled by torch.jit.script (TorchScript): its "
            "attention backend is chosen and run in Python. Use torch.compile (one graph with "
            "fullgraph=True on the 'native' backend) or torch.export instead."
        )
