"""Per-structure analysis of batched MD: RDF, MSD, VACF, stress ACF.

Every function takes one trajectory per structure (ASE ``.traj``/extxyz files
as the package's MD classes write them with ``trajectory="md_{i}.traj"``, or
lists of ``Atoms``) and returns one result per structure; the observers in
:mod:`~nvalchemi_ase.analysis.observers` compute the same results on the fly
from a running batched MD, keeping no frames.

==================================  ============================================
function / observer                 result (units)
==================================  ============================================
``radial_distribution``             g(r) and partial g_ab(r), r in Å (= ASE's
                                    ``get_rdf``)
``mean_squared_displacement``       MSD Å², Einstein D Å²/fs ± block error
``velocity_autocorrelation``        VACF Å²/fs², Green–Kubo D Å²/fs ± block error
``shear_viscosity``                 stress ACF (eV/Å³)², Green–Kubo η mPa·s ± block
                                    error
``TransportObserver``               the three above, streamed
``RDFObserver``                     the RDFs, streamed
``nernst_einstein_conductivity``    σ_NE S/m from each element's D and charge
==================================  ============================================

``DiffusionResult.diffusion_cm2_s`` gives D in cm²/s; :mod:`.conversions`
holds the unit helpers. Times given to the functions (``frame_interval``) are
in ASE time units, as ASE's MD ``timestep``.
"""

from __future__ import annotations

from nvalchemi_ase.analysis.conductivity import (
    ConductivityResult,
    nernst_einstein_conductivity,
)
from nvalchemi_ase.analysis.diffusion import DiffusionResult
from nvalchemi_ase.analysis.frames import Frames, load_trajectories
from nvalchemi_ase.analysis.msd import mean_squared_displacement
from nvalchemi_ase.analysis.observers import RDFObserver, TransportObserver
from nvalchemi_ase.analysis.rdf import RDFResult, radial_distribution
from nvalchemi_ase.analysis.vacf import velocity_autocorrelation
from nvalchemi_ase.analysis.viscosity import ViscosityResult, shear_viscosity

__all__ = [
    "ConductivityResult",
    "DiffusionResult",
    "Frames",
    "RDFObserver",
    "RDFResult",
    "TransportObserver",
    "ViscosityResult",
    "load_trajectories",
    "mean_squared_displacement",
    "nernst_einstein_conductivity",
    "radial_distribution",
    "shear_viscosity",
    "velocity_autocorrelation",
]
