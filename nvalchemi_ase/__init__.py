"""ASE plugin for NVIDIA ALCHEMI Toolkit (``nvalchemi``).

An ASE calculator, lossless Atoms⇄Batch adapters and ASE-style batched dynamics.
Importing this package is fast and silent: nvalchemi (and its Warp banner) is
imported only when a model, batch or engine is first needed.

>>> from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch, batch_to_atoms
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from nvalchemi_ase.calculator import NVAlchemiCalculator as NVAlchemiCalculator
    from nvalchemi_ase.convert import StructureError as StructureError
    from nvalchemi_ase.convert import atoms_to_batch as atoms_to_batch
    from nvalchemi_ase.convert import batch_to_atoms as batch_to_atoms
    from nvalchemi_ase.convert import update_atoms as update_atoms
    from nvalchemi_ase.models import available_models as available_models
    from nvalchemi_ase.models import load_model as load_model
    from nvalchemi_ase.runners import irelax as irelax
    from nvalchemi_ase.runners import read_results as read_results
    from nvalchemi_ase.runners import relax as relax
    from nvalchemi_ase.runners import single_points as single_points
    from nvalchemi_ase.tables import to_dataframe as to_dataframe

_EXPORTS = {
    "NVAlchemiCalculator": "nvalchemi_ase.calculator",
    "StructureError": "nvalchemi_ase.convert",
    "atoms_to_batch": "nvalchemi_ase.convert",
    "batch_to_atoms": "nvalchemi_ase.convert",
    "update_atoms": "nvalchemi_ase.convert",
    "available_models": "nvalchemi_ase.models",
    "load_model": "nvalchemi_ase.models",
    "irelax": "nvalchemi_ase.runners",
    "read_results": "nvalchemi_ase.runners",
    "relax": "nvalchemi_ase.runners",
    "single_points": "nvalchemi_ase.runners",
    "to_dataframe": "nvalchemi_ase.tables",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'nvalchemi_ase' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__() -> list[str]:
    return __all__
