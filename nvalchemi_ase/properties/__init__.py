"""Batched property workflows: EOS, elastic, phonons, vibrations, surfaces, defects.

Every function takes a list of materials and a model (a name, an nvalchemi
model or an :class:`~nvalchemi_ase.calculator.NVAlchemiCalculator`), builds
every derived structure of every material (scaled, strained or displaced
cells), evaluates them all in batched ``calculate_batch`` calls or relaxes
them all together, each converging on its own (ions at fixed cell through
the in-flight runner, :func:`nvalchemi_ase.runners.relax`, which converged
structures leave; cells in one batched optimizer run), and returns one
result per material, in input order. A material whose structures fail is
returned with ``error`` set; the others finish.

=========================  ==================================  ===================
function                   result (units)                      library for the fit
=========================  ==================================  ===================
``equation_of_state``      V0 Å³, E0 eV, B GPa, raw (V, E)     ``ase.eos``
``elastic_constants``      C 6x6 GPa, K/G Voigt-Reuss-Hill     least squares (as
                           GPa                                 matscipy)
``phonons``                force constants eV/Å², THz on a     phonopy (extra
                           path and a mesh, DOS                ``properties``)
``vibrations``             Hessian eV/Å², cm⁻¹ / THz           ``ase.vibrations``
``thermal_conductivity``   κ tensor W/(m K) per T, force-sum   phono3py (extra
                           and Γ acoustic checks               ``kappa``)
``qha``                    V(T) Å³, β(T) 1/K, B(T) GPa, G(T)   phonopy
                           eV                                  ``run_qha``
=========================  ==================================  ===================

Energies of derived structures (every slab, supercell and reference of every
material relaxed in one in-flight run; structures from ``ase.build``):
``surface_energies`` (γ per facet, eV/Å² and J/m²), ``adsorption_energies``
(E_ads per adsorbate and site, eV) and ``defect_formation_energies`` (E_f per
vacancy, interstitial or substitution, eV).
"""

from __future__ import annotations

from nvalchemi_ase.properties.adsorption import AdsorptionResult, adsorption_energies
from nvalchemi_ase.properties.defects import DefectResult, defect_formation_energies
from nvalchemi_ase.properties.elastic import ElasticResult, elastic_constants, moduli
from nvalchemi_ase.properties.eos import EOSResult, equation_of_state
from nvalchemi_ase.properties.kappa import (
    ThermalConductivityResult,
    thermal_conductivity,
)
from nvalchemi_ase.properties.phonons import PhononResult, phonons
from nvalchemi_ase.properties.qha import QHAResult, qha
from nvalchemi_ase.properties.surfaces import SurfaceResult, surface_energies
from nvalchemi_ase.properties.vibrations import VibrationResult, vibrations

__all__ = [
    "AdsorptionResult",
    "DefectResult",
    "EOSResult",
    "ElasticResult",
    "PhononResult",
    "QHAResult",
    "SurfaceResult",
    "ThermalConductivityResult",
    "VibrationResult",
    "adsorption_energies",
    "defect_formation_energies",
    "elastic_constants",
    "equation_of_state",
    "moduli",
    "phonons",
    "qha",
    "surface_energies",
    "thermal_conductivity",
    "vibrations",
]
