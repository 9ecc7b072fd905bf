"""Minimum-energy paths: ASE's NEB batched over images, and many paths at once.

=====================  =========================================================
name                   what it is
=====================  =========================================================
:class:`NEB`           ``ase.mep.NEB`` whose images are evaluated in one model
                       call per force evaluation; drive it with ASE's
                       optimizers (``FIRE(neb)``, ``BFGS(neb)``), read it with
                       ``NEBTools``: the same numbers as ASE's
:func:`relax_paths`    P bands (different lengths and sizes) relaxed in one
                       batch on nvalchemi's NEB engine, each path converging on
                       its own; one :class:`PathResult` per path
:func:`plot_bands`     energy along each relaxed band, one PNG
=====================  =========================================================

Units are ASE's: Å, eV, eV/Å (forces), eV/Å² (spring constants).
"""

from nvalchemi_ase.mep.monitor import PathFailure
from nvalchemi_ase.mep.neb import NEB
from nvalchemi_ase.mep.paths import PathResult, relax_paths
from nvalchemi_ase.mep.plot import plot_bands

__all__ = ["NEB", "PathFailure", "PathResult", "plot_bands", "relax_paths"]
