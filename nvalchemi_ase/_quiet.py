"""Import nvalchemi without its side effects on the caller's process.

Importing ``nvalchemi`` (0.3) has effects a library must not pass on to its users:
Warp prints a multi-line banner to **stdout**, ``nvalchemi.models.base`` calls
``warnings.simplefilter("once", UserWarning)`` for the whole process, and
``nvalchemi._optional`` may replace ``sys.excepthook``. :func:`import_quietly`
imports a module with stdout captured, then restores the warning filters and the
excepthook exactly as the caller had them. Every nvalchemi import in this package
goes through it, inside the function that needs it, so ``import nvalchemi_ase``
stays fast and silent.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import warnings
from types import ModuleType

__all__ = ["import_quietly"]


def import_quietly(module_name: str) -> ModuleType:
    """Import ``module_name`` with nvalchemi's import-time side effects undone.

    Parameters
    ----------
    module_name : str
        Dotted module name, e.g. ``"nvalchemi.data"``.

    Returns
    -------
    types.ModuleType
        The imported module (cached by Python after the first call).
    """
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    saved_excepthook = sys.excepthook
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        module = importlib.import_module(module_name)
        _initialise_warp()
    sys.excepthook = saved_excepthook
    return module


def _initialise_warp() -> None:
    """Run Warp's one-time initialisation (it prints its banner) while muted."""
    warp = sys.modules.get("warp")
    if warp is not None and hasattr(warp, "init"):
        warp.init()
