"""Stress autocorrelation per structure and the Green–Kubo shear viscosity.

The pressure tensor of a frame is ``P = (Σ_i m_i v_i v_iᵀ) / V - σ`` (kinetic
part plus the virial; ``σ`` is ASE's tensile-positive stress, eV/Å³). Its
symmetric traceless part ``Q = (P + Pᵀ)/2 - tr(P)/3 · 1`` carries the shear
stresses; for an isotropic fluid all nine entries together give (Daivis & Evans,
J. Chem. Phys. 100, 541 (1994))::

    C(t) = (1/10) Σ_ab <Q_ab(t0) Q_ab(t0 + t)>        # (eV/Å³)²
    η    = V / (kB T) ∫_0^∞ C(t) dt

which equals the single-component ``<P_xy(0) P_xy(t)>`` on average while using
five independent components. ``V`` and ``T`` are the run's mean volume and
mean kinetic temperature (``2 E_kin / (3 N kB)``) unless ``temperature_K`` is
given. The integral is the trapezoid rule up to ``integrate_to_fs``;
``running_viscosity`` holds it at every upper limit. Uncertainty: block
standard error (:mod:`~nvalchemi_ase.analysis.diffusion`), in mPa·s. Shear
viscosities converge slowly: expect large error bars on short runs of small
cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from ase import units

from nvalchemi_ase.analysis.conversions import viscosity_ase_to_mpa_s
from nvalchemi_ase.analysis.correlation import LagSums, lag_sums
from nvalchemi_ase.analysis.diffusion import block_standard_error
from nvalchemi_ase.analysis.frames import Frames, FramesLike, load_trajectories
from nvalchemi_ase.analysis.msd import resolve_lengths
from nvalchemi_ase.analysis.vacf import cumulative_trapezoid, integration_end

__all__ = [
    "ViscosityResult",
    "green_kubo_viscosity",
    "pressure_tensor",
    "shear_viscosity",
    "traceless_pressure",
]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ViscosityResult:
    """Green–Kubo shear viscosity of one structure.

    Attributes
    ----------
    label : str
        The structure.
    lag_fs : numpy.ndarray, shape (W,)
        Lag times, fs.
    acf : numpy.ndarray, shape (W,)
        ``C(t)``, (eV/Å³)² (see the module docstring).
    running_viscosity : numpy.ndarray, shape (W,)
        ``V/(kB T) ∫_0^t C``, mPa·s.
    viscosity : float
        η, mPa·s.
    viscosity_error : float
        Block standard error of η, mPa·s.
    window_fs : tuple of float
        Integration range, fs.
    block_viscosity : numpy.ndarray, shape (n_blocks,)
        η of each block, mPa·s.
    block_length : int
        Samples per block.
    volume : float
        Mean volume, Å³.
    temperature_K : float
        Temperature used, K.
    """

    label: str
    lag_fs: FloatArray
    acf: FloatArray
    running_viscosity: FloatArray
    viscosity: float
    viscosity_error: float
    window_fs: tuple[float, float]
    block_viscosity: FloatArray
    block_length: int
    volume: float
    temperature_K: float

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form for JSON (NaN becomes None), units in the keys.

        Returns
        -------
        dict
            Every field, arrays as lists.
        """

        def number(value: float) -> float | None:
            return float(value) if np.isfinite(value) else None

        return {
            "label": self.label,
            "viscosity_mPa_s": number(self.viscosity),
            "viscosity_error_mPa_s": number(self.viscosity_error),
            "window_fs": list(self.window_fs),
            "n_blocks": int(self.block_viscosity.size),
            "block_length": self.block_length,
            "block_viscosity_mPa_s": [number(v) for v in self.block_viscosity],
            "volume_A3": self.volume,
            "temperature_K": self.temperature_K,
            "lag_fs": self.lag_fs.tolist(),
            "acf_eV2_per_A6": [number(v) for v in self.acf],
            "running_viscosity_mPa_s": [number(v) for v in self.running_viscosity],
        }


def pressure_tensor(
    stress: torch.Tensor,
    velocities: torch.Tensor,
    masses: torch.Tensor,
    volume: torch.Tensor,
    structure_of_atom: torch.Tensor,
    n_structures: int,
) -> torch.Tensor:
    """Kinetic plus virial pressure tensor of every structure.

    Parameters
    ----------
    stress : torch.Tensor, shape (B, 3, 3)
        ASE stress (virial part, tensile positive), eV/Å³.
    velocities : torch.Tensor, shape (M, 3)
        Velocities, Å/ASE-time.
    masses : torch.Tensor, shape (M,)
        Masses, amu.
    volume : torch.Tensor, shape (B,)
        Volumes, Å³.
    structure_of_atom : torch.Tensor, shape (M,), long
        Structure of each atom.
    n_structures : int
        B.

    Returns
    -------
    torch.Tensor, shape (B, 3, 3)
        ``Σ m v vᵀ / V - σ``, eV/Å³.
    """
    outer = masses[:, None, None] * velocities[:, :, None] * velocities[:, None, :]
    kinetic = stress.new_zeros(n_structures, 3, 3).index_add_(
        0, structure_of_atom, outer.to(stress.dtype)
    )
    return kinetic / volume[:, None, None] - stress


def traceless_pressure(pressure: torch.Tensor) -> torch.Tensor:
    """Symmetric traceless part of pressure tensors, flattened.

    Parameters
    ----------
    pressure : torch.Tensor, shape (..., 3, 3)
        Pressure tensors, eV/Å³.

    Returns
    -------
    torch.Tensor, shape (..., 9)
        ``(P + Pᵀ)/2 - tr(P)/3 · 1``, row-major.
    """
    symmetric = 0.5 * (pressure + pressure.transpose(-1, -2))
    trace = symmetric.diagonal(dim1=-2, dim2=-1).sum(-1) / 3.0
    eye = torch.eye(3, dtype=pressure.dtype, device=pressure.device)
    traceless = symmetric - trace[..., None, None] * eye
    return traceless.reshape(*pressure.shape[:-2], 9)


def kinetic_temperature(
    velocities: torch.Tensor,
    masses: torch.Tensor,
    structure_of_atom: torch.Tensor,
    n_structures: int,
) -> torch.Tensor:
    """``2 E_kin / (3 N kB)`` of every structure, K.

    Parameters
    ----------
    velocities : torch.Tensor, shape (..., M, 3)
        Velocities, Å/ASE-time.
    masses : torch.Tensor, shape (M,)
        Masses, amu.
    structure_of_atom : torch.Tensor, shape (M,), long
        Structure of each atom.
    n_structures : int
        B.

    Returns
    -------
    torch.Tensor, shape (..., B)
        Temperatures, K.
    """
    energy = 0.5 * masses * (velocities * velocities).sum(-1)
    shape = (*velocities.shape[:-2], n_structures)
    ekin = energy.new_zeros(shape).index_add_(-1, structure_of_atom, energy)
    atoms = energy.new_zeros(n_structures).index_add_(
        0, structure_of_atom, torch.ones_like(masses, dtype=energy.dtype)
    )
    return 2.0 * ekin / (3.0 * atoms * units.kB)


def shear_viscosity(
    trajectories: Sequence[FramesLike],
    frame_interval: float | Sequence[float | None] | None = None,
    *,
    window: int | None = None,
    block_length: int | None = None,
    integrate_to_fs: float | None = None,
    temperature_K: float | Sequence[float] | None = None,
) -> list[ViscosityResult]:
    """Green–Kubo shear viscosity of every structure, from frames.

    Parameters
    ----------
    trajectories : sequence of (path, list of Atoms, or Frames)
        One entry per structure; every frame needs momenta and a stress (MD
        trajectories written by this package's MD classes carry both).
    frame_interval : float, sequence of float, or None
        Time between frames, ASE time units (None: from each ``.traj`` header).
    window : int, optional
        Lags computed, in frames (default: ``block_length``).
    block_length : int, optional
        Frames per block of the error estimate (default: a fifth of the run).
    integrate_to_fs : float, optional
        Upper limit of the integral, fs (default: the largest lag).
    temperature_K : float or sequence of float, optional
        Temperature in ``η = V/(kB T) ∫ C``, K (default: each run's mean
        kinetic temperature).

    Returns
    -------
    list of ViscosityResult
        One per structure, in input order.
    """
    loaded = load_trajectories(trajectories, frame_interval)
    temperatures = _per_structure(temperature_K, len(loaded))
    results = []
    for index, frames in enumerate(loaded):
        _check_stress_frames(index, frames)
        sample_window, blocks = resolve_lengths(frames.n_frames, window, block_length)
        sums, volume, temperature = _stress_sums(frames, sample_window, blocks)
        chosen = temperatures[index]
        results.append(
            green_kubo_viscosity(
                sums,
                volume,
                temperature if chosen is None else chosen,
                frames.frame_interval,  # type: ignore[arg-type]
                blocks,
                label=frames.label,
                integrate_to_fs=integrate_to_fs,
            )
        )
    return results


def _per_structure(
    value: float | Sequence[float] | None, count: int
) -> list[float | None]:
    if value is None or np.isscalar(value):
        return [value] * count  # type: ignore[list-item]
    values = [float(v) for v in value]  # type: ignore[union-attr]
    if len(values) != count:
        raise ValueError(f"temperature_K has {len(values)} values for {count} runs")
    return values  # type: ignore[return-value]


def _check_stress_frames(index: int, frames: Frames) -> None:
    missing = [
        name
        for name, value in (("momenta", frames.velocities), ("stress", frames.stress))
        if value is None
    ]
    if missing:
        raise ValueError(
            f"trajectories[{index}] ({frames.label}): frames without "
            f"{' and '.join(missing)}; the stress autocorrelation needs both"
        )
    if not frames.pbc.all():
        raise ValueError(
            f"trajectories[{index}] ({frames.label}): viscosity needs a fully "
            "periodic cell"
        )


def _stress_sums(
    frames: Frames, window: int, block_length: int
) -> tuple[LagSums, float, float]:
    velocities = torch.as_tensor(frames.velocities)
    masses = torch.as_tensor(frames.masses)
    cells = torch.as_tensor(frames.cells)
    volume = torch.linalg.det(cells).abs()  # (T,)
    structure = torch.zeros(frames.n_atoms, dtype=torch.long)
    stress = torch.as_tensor(frames.stress)
    # frames as the "structures" of one call: (T, 3, 3)
    frame_of_atom = torch.arange(frames.n_frames).repeat_interleave(frames.n_atoms)
    pressure = pressure_tensor(
        stress,
        velocities.reshape(-1, 3),
        masses.repeat(frames.n_frames),
        volume,
        frame_of_atom,
        frames.n_frames,
    )
    series = traceless_pressure(pressure)[:, None, :]  # (T, 1, 9)
    sums = lag_sums(
        series, torch.zeros(1, dtype=torch.long), 1, window, block_length, "product"
    )
    temperature = kinetic_temperature(velocities, masses, structure, 1)
    return sums, float(volume.mean()), float(temperature.mean())


def green_kubo_viscosity(
    sums: LagSums,
    volume: float,
    temperature_K: float,
    frame_interval: float,
    block_length: int,
    *,
    label: str,
    integrate_to_fs: float | None = None,
) -> ViscosityResult:
    """Turn one structure's traceless-pressure product sums into η.

    Parameters
    ----------
    sums : LagSums
        ``"product"`` sums of the 9 traceless pressure entries (one group).
    volume : float
        Mean volume, Å³.
    temperature_K : float
        Temperature, K.
    frame_interval : float
        Time between samples, ASE time units.
    block_length : int
        Samples per block.
    label : str
        The structure's name.
    integrate_to_fs : float, optional
        Upper limit of the integral, fs.

    Returns
    -------
    ViscosityResult
        The viscosity and its curves.
    """
    if not temperature_K > 0:
        raise ValueError(f"{label}: temperature must be positive, got {temperature_K}")
    acf = sums.total[:, 0].cpu().numpy() / sums.counts.cpu().numpy() / 10.0
    blocks = sums.blocks[:, :, 0].cpu().numpy() / sums.block_counts.cpu().numpy()
    blocks = blocks / 10.0
    lag_fs = np.arange(acf.size, dtype=np.float64) * (frame_interval / units.fs)
    end = integration_end(lag_fs, integrate_to_fs)
    factor = volume / (units.kB * temperature_K)
    running = viscosity_ase_to_mpa_s(factor * cumulative_trapezoid(acf, frame_interval))
    block_values = (
        viscosity_ase_to_mpa_s(
            factor * cumulative_trapezoid(blocks, frame_interval)[..., end]
        )
        if len(blocks)
        else np.zeros(0)
    )
    return ViscosityResult(
        label=label,
        lag_fs=lag_fs,
        acf=acf,
        running_viscosity=running,
        viscosity=float(running[end]),
        viscosity_error=block_standard_error(block_values),
        window_fs=(0.0, float(lag_fs[end])),
        block_viscosity=np.asarray(block_values, dtype=np.float64),
        block_length=int(block_length),
        volume=float(volume),
        temperature_K=float(temperature_K),
    )
