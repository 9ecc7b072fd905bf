"""Unit helpers for transport coefficients (ASE units in, common units out).

The analysis functions report diffusion coefficients in Å²/fs and viscosities
in mPa·s; these helpers convert between them and the units papers quote.
``1 Å²/fs = 1e-16 cm² / 1e-15 s = 0.1 cm²/s``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
from ase import units

__all__ = [
    "A2_PER_FS_TO_CM2_PER_S",
    "diffusion_a2_per_fs_to_cm2_per_s",
    "diffusion_ase_to_a2_per_fs",
    "viscosity_ase_to_mpa_s",
]

Scalar = TypeVar("Scalar", float, np.ndarray)

#: One Å²/fs in cm²/s.
A2_PER_FS_TO_CM2_PER_S = 0.1


def diffusion_ase_to_a2_per_fs(value: Scalar) -> Scalar:
    """Convert a diffusion coefficient from Å²/ASE-time to Å²/fs.

    Parameters
    ----------
    value : float or numpy.ndarray
        D in Å² per ASE time unit.

    Returns
    -------
    float or numpy.ndarray
        D in Å²/fs.
    """
    return value * units.fs


def diffusion_a2_per_fs_to_cm2_per_s(value: Scalar) -> Scalar:
    """Convert a diffusion coefficient from Å²/fs to cm²/s.

    Parameters
    ----------
    value : float or numpy.ndarray
        D in Å²/fs.

    Returns
    -------
    float or numpy.ndarray
        D in cm²/s.
    """
    return value * A2_PER_FS_TO_CM2_PER_S


def viscosity_ase_to_mpa_s(value: Scalar) -> Scalar:
    """Convert a viscosity from eV/Å³ × ASE time to mPa·s.

    Parameters
    ----------
    value : float or numpy.ndarray
        Viscosity in (eV/Å³)·(ASE time), the unit of ``V/(kB T) ∫ <P P> dt``
        with ASE quantities.

    Returns
    -------
    float or numpy.ndarray
        Viscosity in mPa·s.
    """
    return value / units.Pascal / units.second * 1e3
