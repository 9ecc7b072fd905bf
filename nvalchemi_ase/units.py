"""Every unit, sign and layout conversion between ASE and nvalchemi.

ASE units are used in every public API of :mod:`nvalchemi_ase`; this module is the
only place that converts them into what nvalchemi's engines expect. Each function is
pure, NumPy- or torch-friendly, and states both units.

=================  ===============================  ===============================
quantity           ASE                              nvalchemi 0.3
=================  ===============================  ===============================
length, energy     Å, eV                            Å, eV (no conversion)
force, stress      eV/Å, eV/Å³                      eV/Å, eV/Å³ (no conversion)
stress layout      Voigt (6,) xx yy zz yz xz xy     full tensor [B, 3, 3]
stress sign        tensile positive, (1/V) ∂E/∂ε    tensile positive (same sign)
pressure           eV/Å³ (``pressure_au``)          eV/Å³ (no conversion)
time (MD args)     ASE time unit (≈ 10.1805 fs)     fs (integrator ``dt``, coupling
                                                    times)
time (optimizers)  ASE time unit                    internal unit = ASE time unit
rates              1/ASE-time (Langevin friction)   1/fs
velocities         Å per ASE time unit              Å per ASE time unit (same)
temperature        K with ``ase.units.kB``          K with ``KB_EV`` (CODATA 2018)
cell               rows are lattice vectors         rows are lattice vectors
=================  ===============================  ===============================

nvalchemi's internal time unit *is* the ASE time unit; its integrators take
femtoseconds and divide by ``FS_PER_INTERNAL_TIME``. Converting with that same
constant makes the time step the kernels see equal, bit for bit, to the ASE
``timestep`` (converting with ``ase.units.fs`` would leave a 3.9e-9 relative error).
Likewise temperatures are rescaled by ``ase.units.kB / KB_EV`` so that the thermal
energy kT the kernels use equals ASE's ``units.kB * temperature_K``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch
from ase import units as ase_units

__all__ = [
    "FS_PER_ASE_TIME",
    "KB_EV_NVALCHEMI",
    "ase_rate_to_per_fs",
    "ase_time_to_fs",
    "ase_time_to_ps",
    "fs_to_ase_time",
    "kinetic_temperature_K",
    "momenta_to_velocities",
    "nvalchemi_temperature_to_K",
    "pressure_from_stress",
    "stress_3x3_to_voigt",
    "temperature_K_to_nvalchemi",
    "thermal_energy_nvalchemi",
    "velocities_to_momenta",
    "voigt_to_stress_3x3",
]

Scalar = TypeVar("Scalar", float, npt.NDArray[np.float64], torch.Tensor)

#: Femtoseconds per ASE (= nvalchemi internal) time unit, exactly the constant
#: ``nvalchemi.dynamics._units.FS_PER_INTERNAL_TIME`` (a test pins the equality).
FS_PER_ASE_TIME: float = 10.180505710759414

#: Boltzmann constant nvalchemi uses, eV/K (``nvalchemi.dynamics.KB_EV``).
KB_EV_NVALCHEMI: float = 8.617333262e-5

# Voigt index pairs in ASE order: xx, yy, zz, yz, xz, xy.
_VOIGT_ROWS = np.array([0, 1, 2, 1, 0, 0])
_VOIGT_COLS = np.array([0, 1, 2, 2, 2, 1])


def ase_time_to_fs(time: Scalar) -> Scalar:
    """Convert a time from ASE time units to femtoseconds.

    Parameters
    ----------
    time : float or numpy.ndarray
        Time in ASE units (``1 * ase.units.fs`` ≈ 0.0982).

    Returns
    -------
    float or numpy.ndarray
        Time in fs, as nvalchemi's integrators (``dt``, ``thermostat_time``,
        ``barostat_time``) expect.
    """
    return time * FS_PER_ASE_TIME


def ase_time_to_ps(time: Scalar) -> Scalar:
    """Convert a time from ASE time units to picoseconds (MD logs and plots).

    Parameters
    ----------
    time : float or numpy.ndarray
        Time in ASE units.

    Returns
    -------
    float or numpy.ndarray
        Time in ps: ``time / (1000 * ase.units.fs)``.
    """
    return time / (1000 * ase_units.fs)


def fs_to_ase_time(time_fs: Scalar) -> Scalar:
    """Convert a time in femtoseconds to ASE time units (inverse of ase_time_to_fs).

    Parameters
    ----------
    time_fs : float or numpy.ndarray
        Time in fs.

    Returns
    -------
    float or numpy.ndarray
        Time in ASE units.
    """
    return time_fs / FS_PER_ASE_TIME


def ase_rate_to_per_fs(rate: Scalar) -> Scalar:
    """Convert a rate (e.g. Langevin friction) from 1/ASE-time to 1/fs.

    Parameters
    ----------
    rate : float or numpy.ndarray
        Rate in inverse ASE time units (``0.01 / ase.units.fs`` is 0.01 fs⁻¹).

    Returns
    -------
    float or numpy.ndarray
        Rate in 1/fs, as ``nvalchemi.dynamics.NVTLangevin(friction=...)`` expects.
    """
    return rate / FS_PER_ASE_TIME


def temperature_K_to_nvalchemi(temperature_K: Scalar) -> Scalar:
    """Rescale an ASE temperature so nvalchemi's kT equals ASE's kT.

    Parameters
    ----------
    temperature_K : float or numpy.ndarray
        Temperature in K, as ASE reads it (``ase.units.kB * temperature_K`` eV).

    Returns
    -------
    float or numpy.ndarray
        Temperature in K for nvalchemi, whose ``KB_EV`` differs from
        ``ase.units.kB`` by 3.4e-7 relative.
    """
    return temperature_K * (ase_units.kB / KB_EV_NVALCHEMI)


def nvalchemi_temperature_to_K(temperature: Scalar) -> Scalar:
    """Inverse of :func:`temperature_K_to_nvalchemi`.

    Parameters
    ----------
    temperature : float or numpy.ndarray
        Temperature in K as nvalchemi computes it (with ``KB_EV``).

    Returns
    -------
    float or numpy.ndarray
        Temperature in K as ASE would report it (with ``ase.units.kB``).
    """
    return temperature * (KB_EV_NVALCHEMI / ase_units.kB)


def momenta_to_velocities(
    momenta: npt.NDArray[np.float64], masses: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Convert ASE momenta to velocities.

    Parameters
    ----------
    momenta : numpy.ndarray, shape (V, 3)
        Momenta in amu·Å/ASE-time (``Atoms.get_momenta()``).
    masses : numpy.ndarray, shape (V,)
        Masses in amu.

    Returns
    -------
    numpy.ndarray, shape (V, 3)
        Velocities in Å/ASE-time, the unit of nvalchemi's ``batch.velocities``.
    """
    return momenta / masses[:, None]


def velocities_to_momenta(
    velocities: npt.NDArray[np.float64], masses: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Convert velocities (Å/ASE-time) to ASE momenta (amu·Å/ASE-time).

    Parameters
    ----------
    velocities : numpy.ndarray, shape (V, 3)
        Velocities in Å/ASE-time.
    masses : numpy.ndarray, shape (V,)
        Masses in amu.

    Returns
    -------
    numpy.ndarray, shape (V, 3)
        Momenta for ``Atoms.set_momenta``.
    """
    return velocities * masses[:, None]


def stress_3x3_to_voigt(stress: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Convert full stress tensors to ASE's Voigt vectors.

    The sign is unchanged: nvalchemi and ASE both report tensile-positive Cauchy
    stress, (1/V) ∂E/∂ε.

    Parameters
    ----------
    stress : numpy.ndarray, shape (..., 3, 3)
        Stress tensors in eV/Å³ (nvalchemi's ``batch.stress`` is [B, 3, 3]).

    Returns
    -------
    numpy.ndarray, shape (..., 6)
        Voigt order xx, yy, zz, yz, xz, xy, eV/Å³; the off-diagonal entries are
        the mean of the two symmetric components.
    """
    upper = stress[..., _VOIGT_ROWS, _VOIGT_COLS]
    lower = stress[..., _VOIGT_COLS, _VOIGT_ROWS]
    return 0.5 * (upper + lower)


def voigt_to_stress_3x3(voigt: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Convert ASE Voigt stress vectors to full symmetric tensors.

    Parameters
    ----------
    voigt : numpy.ndarray, shape (..., 6)
        Voigt order xx, yy, zz, yz, xz, xy, eV/Å³.

    Returns
    -------
    numpy.ndarray, shape (..., 3, 3)
        Symmetric stress tensors, eV/Å³.
    """
    voigt = np.asarray(voigt, dtype=np.float64)
    full = np.empty((*voigt.shape[:-1], 3, 3))
    full[..., _VOIGT_ROWS, _VOIGT_COLS] = voigt
    full[..., _VOIGT_COLS, _VOIGT_ROWS] = voigt
    return full


def pressure_from_stress(
    stress_voigt: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """Return the pressure -tr(σ)/3 of Voigt stresses.

    Parameters
    ----------
    stress_voigt : numpy.ndarray, shape (..., 6)
        ASE Voigt stress, eV/Å³ (tensile positive).

    Returns
    -------
    numpy.ndarray, shape (...)
        Pressure in eV/Å³ (compressive positive; divide by ``ase.units.GPa``
        for GPa).
    """
    return -np.asarray(stress_voigt)[..., :3].sum(axis=-1) / 3.0


def kinetic_temperature_K(kinetic_energy: Scalar, degrees_of_freedom: Scalar) -> Scalar:
    """Temperature from kinetic energy, as ``Atoms.get_temperature`` computes it.

    Parameters
    ----------
    kinetic_energy : float or numpy.ndarray
        Kinetic energy in eV.
    degrees_of_freedom : float or numpy.ndarray
        Number of unconstrained degrees of freedom (3N minus those removed by
        constraints, as ASE counts them).

    Returns
    -------
    float or numpy.ndarray
        Temperature in K, 2 E_kin / (dof k_B) with ``ase.units.kB``.
    """
    return 2.0 * kinetic_energy / (degrees_of_freedom * ase_units.kB)


def thermal_energy_nvalchemi(temperature: Scalar) -> Scalar:
    """Thermal energy of a temperature given in nvalchemi's convention.

    Parameters
    ----------
    temperature : float, numpy.ndarray or torch.Tensor
        Temperature in K as nvalchemi's engines take it (their ``KB_EV``; an
        ASE temperature goes through :func:`temperature_K_to_nvalchemi` first).

    Returns
    -------
    float, numpy.ndarray or torch.Tensor
        k_B T in eV, with ``KB_EV_NVALCHEMI``; for an ASE temperature converted
        as above this equals ``ase.units.kB * temperature_K``.
    """
    return temperature * KB_EV_NVALCHEMI
