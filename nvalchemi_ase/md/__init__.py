"""Batched molecular dynamics with ASE's class names, arguments and units.

=========================  ======================================================
class                      nvalchemi engine
=========================  ======================================================
``VelocityVerlet``         ``NVE``
``Langevin``               ``NVTLangevin`` (BAOAB)
``NoseHooverChainNVT``     ``NVTNoseHoover``
``IsotropicMTKNPT``        ``NPT(pressure_coupling="isotropic")``
``MTKNPT``                 ``NPT(pressure_coupling="triclinic")``
``NPH``                    ``NPH`` (no ASE counterpart)
=========================  ======================================================
"""

from nvalchemi_ase.md.langevin import Langevin
from nvalchemi_ase.md.md import BatchedMolecularDynamics
from nvalchemi_ase.md.nosehoover import NoseHooverChainNVT
from nvalchemi_ase.md.npt import MTKNPT, NPH, IsotropicMTKNPT
from nvalchemi_ase.md.verlet import VelocityVerlet

__all__ = [
    "MTKNPT",
    "NPH",
    "BatchedMolecularDynamics",
    "IsotropicMTKNPT",
    "Langevin",
    "NoseHooverChainNVT",
    "VelocityVerlet",
]
