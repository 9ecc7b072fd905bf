"""Batched structure optimization with ASE's class names, arguments and units.

=============  ==================================  =================================
class          nvalchemi engine                    with a cell filter
=============  ==================================  =================================
``FIRE``       ``nvalchemi_ase.engines.ASEFIRE``   the same, on ASE's filter rows
``FIRE2``      ``FIRE2``                           ``FIRE2VariableCell``
``LBFGS``      ``LBFGS``                           ``LBFGSVariableCell``
``BFGS``       ``nvalchemi_ase.engines.ASEBFGS``   the same, on ASE's filter rows
``MDMin``      ``nvalchemi_ase.engines.ASEMDMin``  the same, on ASE's filter rows
=============  ==================================  =================================

``FIRE``, ``BFGS`` and ``MDMin`` run batched engines of this package (ASE's
algorithms; nvalchemi 0.3 has none, or a different FIRE): each structure
follows ASE's path for it step for step, under ``FrechetCellFilter`` or
``UnitCellFilter`` too (the engines move the filter's N + 3 generalized rows,
:mod:`nvalchemi_ase.engines.cell_filter`, in the user's frame).
"""

from nvalchemi_ase.optimize.bfgs import BFGS
from nvalchemi_ase.optimize.fire import FIRE, FIRE2
from nvalchemi_ase.optimize.lbfgs import LBFGS
from nvalchemi_ase.optimize.mdmin import MDMin
from nvalchemi_ase.optimize.optimize import DEFAULT_MAX_STEPS, BatchedOptimizer

__all__ = [
    "BFGS",
    "DEFAULT_MAX_STEPS",
    "FIRE",
    "FIRE2",
    "LBFGS",
    "BatchedOptimizer",
    "MDMin",
]
