"""Batched structure optimization with ASE's class names, arguments and units.

=============  ==================================  =================================
class          nvalchemi engine                    with a cell filter
=============  ==================================  =================================
``FIRE``       ``FIRE``                            refused (0.3's FIREVariableCell
                                                   never moves the cell)
``FIRE2``      ``FIRE2``                           ``FIRE2VariableCell``
``LBFGS``      ``LBFGS``                           ``LBFGSVariableCell``
=============  ==================================  =================================
"""

from nvalchemi_ase.optimize.fire import FIRE, FIRE2
from nvalchemi_ase.optimize.lbfgs import LBFGS
from nvalchemi_ase.optimize.optimize import DEFAULT_MAX_STEPS, BatchedOptimizer

__all__ = ["DEFAULT_MAX_STEPS", "FIRE", "FIRE2", "LBFGS", "BatchedOptimizer"]
