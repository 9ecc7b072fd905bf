"""Batched molecular dynamics with ASE's class names, arguments and units.

=========================  ======================================================
class                      nvalchemi engine
=========================  ======================================================
``VelocityVerlet``         ``NVE``
``Langevin``               ``NVTLangevin`` (BAOAB)
``LangevinBAOAB``          ``nvalchemi_ase.engines.LangevinHooverBAOAB``
``NoseHooverChainNVT``     ``NVTNoseHoover``
``IsotropicMTKNPT``        ``NPT(pressure_coupling="isotropic")``
``MTKNPT``                 ``NPT(pressure_coupling="triclinic")``
``NPH``                    ``NPH`` (no ASE counterpart)
``Bussi``                  ``nvalchemi_ase.engines.NVTBussi``
``NVTBerendsen``           ``nvalchemi_ase.engines.NVTBerendsen`` (ASE's path)
``Andersen``               ``nvalchemi_ase.engines.NVTAndersen``
=========================  ======================================================

``LangevinBAOAB``, ``Bussi``, ``NVTBerendsen`` and ``Andersen`` run batched
engines of this package (nvalchemi 0.3 has none).

Every thermostat and barostat target (``temperature_K``, ``pressure_au``,
``externalstress``) may be a schedule: a callable of the step count or
``(step, value)`` pairs (:func:`piecewise_linear`, :mod:`.schedules`).
"""

from nvalchemi_ase.md.andersen import Andersen
from nvalchemi_ase.md.bussi import Bussi
from nvalchemi_ase.md.langevin import Langevin
from nvalchemi_ase.md.langevinbaoab import LangevinBAOAB
from nvalchemi_ase.md.md import (
    BatchedMolecularDynamics,
    VariableCellMolecularDynamics,
)
from nvalchemi_ase.md.nosehoover import NoseHooverChainNVT
from nvalchemi_ase.md.npt import MTKNPT, NPH, IsotropicMTKNPT
from nvalchemi_ase.md.nvtberendsen import NVTBerendsen
from nvalchemi_ase.md.schedules import Schedule, piecewise_linear
from nvalchemi_ase.md.verlet import VelocityVerlet

__all__ = [
    "MTKNPT",
    "NPH",
    "Andersen",
    "BatchedMolecularDynamics",
    "Bussi",
    "IsotropicMTKNPT",
    "Langevin",
    "LangevinBAOAB",
    "NVTBerendsen",
    "NoseHooverChainNVT",
    "Schedule",
    "VariableCellMolecularDynamics",
    "VelocityVerlet",
    "piecewise_linear",
]
