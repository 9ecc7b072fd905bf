"""ASE plugin registration (entry point group ``ase.plugins``).

ASE 3.29 collects plugins from modules exposing ``__ase_plugins__``, through an
API it keeps under the explicitly unstable ``ase._4`` namespace. This is the
only module that touches it, and it never fails: without that API (older or
newer ASE), ``__ase_plugins__`` is simply empty. Importing it imports neither
torch nor nvalchemi; ASE loads the calculator class only when asked for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["__ase_plugins__"]

CITATION = (
    "nvalchemi_ase: ASE calculator and batched dynamics for NVIDIA ALCHEMI Toolkit"
)


def _plugins() -> set[Any]:
    try:
        from ase._4.plugins.plugin import CalculatorPlugin
    except ImportError:  # ASE without the v4 plugin API
        return set()
    try:
        return {
            CalculatorPlugin(
                "nvalchemi",
                citation=CITATION,
                implementation="nvalchemi_ase.calculator.NVAlchemiCalculator",
            )
        }
    except TypeError:  # the unstable signature changed
        return set()


__ase_plugins__: set[Any] = _plugins()
