"""Velocity autocorrelation per structure and the Green–Kubo self-diffusion coefficient.

``VACF(t) = <v_i(t0) · v_i(t0 + t)>`` averaged over the atoms (of the structure,
or of one element) and every time origin, by default with each structure's
centre-of-mass velocity removed. The Green–Kubo relation gives
``D = (1/3) ∫_0^∞ VACF(t) dt``; the integral is taken by the trapezoid rule up to
``integrate_to_fs`` (default: the whole window), and ``running_diffusion``
holds it at every upper limit so a plateau can be checked. Uncertainty: block
standard error (:mod:`~nvalchemi_ase.analysis.diffusion`). Use unthermostatted
(NVE) or weakly thermostatted runs: a Langevin thermostat damps the VACF.

Units: velocities Å/ASE-time in (ASE's ``get_velocities``), VACF Å²/fs², lag
times fs, D Å²/fs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import numpy.typing as npt
import torch
from ase import units

from nvalchemi_ase.analysis._groups import element_groups, subtract_center_of_mass
from nvalchemi_ase.analysis.correlation import LagSums, lag_sums
from nvalchemi_ase.analysis.diffusion import (
    DiffusionResult,
    block_standard_error,
    per_atom_curves,
)
from nvalchemi_ase.analysis.frames import Frames, FramesLike
from nvalchemi_ase.analysis.msd import diffusion_of_each

__all__ = [
    "cumulative_trapezoid",
    "green_kubo_diffusion",
    "integration_end",
    "velocity_autocorrelation",
]

FloatArray = npt.NDArray[np.float64]


def velocity_autocorrelation(
    trajectories: Sequence[FramesLike],
    frame_interval: float | Sequence[float | None] | None = None,
    *,
    window: int | None = None,
    block_length: int | None = None,
    integrate_to_fs: float | None = None,
    remove_drift: bool = True,
) -> list[DiffusionResult]:
    """VACF and Green–Kubo D of every structure, from frames with momenta.

    Parameters
    ----------
    trajectories : sequence of (path, list of Atoms, or Frames)
        One entry per structure; every frame must carry momenta.
    frame_interval : float, sequence of float, or None
        Time between frames, ASE time units (None: from each ``.traj`` header).
    window : int, optional
        Lags computed, in frames (default: ``block_length``).
    block_length : int, optional
        Frames per block of the error estimate (default: a fifth of the run).
    integrate_to_fs : float, optional
        Upper limit of the Green–Kubo integral, fs (default: the largest lag).
    remove_drift : bool
        Subtract each structure's centre-of-mass velocity first.

    Returns
    -------
    list of DiffusionResult
        One per structure, in input order (``method="vacf"``).
    """
    return diffusion_of_each(
        trajectories,
        frame_interval,
        window,
        block_length,
        lambda index, frames, lags, blocks: _vacf_sums(
            index, frames, lags, blocks, remove_drift
        ),
        partial(green_kubo_diffusion, integrate_to_fs=integrate_to_fs),
    )


def _vacf_sums(
    index: int, frames: Frames, window: int, block_length: int, remove_drift: bool
) -> LagSums:
    if frames.velocities is None:
        raise ValueError(
            f"trajectories[{index}] ({frames.label}): frames without momenta; "
            "the VACF needs velocities (MD trajectories store them)"
        )
    groups = element_groups([frames.numbers])
    velocities = torch.as_tensor(frames.velocities) * units.fs  # Å/fs
    if remove_drift:
        velocities = subtract_center_of_mass(
            velocities, torch.as_tensor(frames.masses), groups.structure_of_atom, 1
        )
    return lag_sums(
        velocities, groups.of_atom, groups.count, window, block_length, "product"
    )


def cumulative_trapezoid(values: FloatArray, step: float) -> FloatArray:
    """Integrate by the trapezoid rule along the last axis, running from 0.

    Parameters
    ----------
    values : numpy.ndarray, shape (..., W)
        Samples at spacing ``step``.
    step : float
        Spacing.

    Returns
    -------
    numpy.ndarray, shape (..., W)
        ``∫_0^{t_k}`` for every k (0 at k = 0).
    """
    pieces = 0.5 * step * (values[..., 1:] + values[..., :-1])
    zero = np.zeros((*values.shape[:-1], 1))
    return np.concatenate([zero, np.cumsum(pieces, axis=-1)], axis=-1)


def integration_end(lag_fs: FloatArray, integrate_to_fs: float | None) -> int:
    """Index of the last lag of a Green–Kubo integral.

    Parameters
    ----------
    lag_fs : numpy.ndarray, shape (W,)
        Lag times, fs.
    integrate_to_fs : float or None
        Upper limit, fs (None: the last lag).

    Returns
    -------
    int
        The last lag index with ``lag <= integrate_to_fs``.
    """
    if integrate_to_fs is None:
        return len(lag_fs) - 1
    if not integrate_to_fs > 0:
        raise ValueError(f"integrate_to_fs must be positive, got {integrate_to_fs}")
    return int(np.searchsorted(lag_fs, integrate_to_fs + 1e-9) - 1)


def green_kubo_diffusion(
    sums: LagSums,
    symbols: Sequence[str],
    sizes: FloatArray,
    frame_interval: float,
    block_length: int,
    *,
    label: str,
    integrate_to_fs: float | None = None,
) -> DiffusionResult:
    """Turn one structure's velocity product sums (Å²/fs²) into its VACF and D.

    Parameters
    ----------
    sums : LagSums
        ``"product"`` sums of velocities in Å/fs, per element group.
    symbols : sequence of str
        Element of each group.
    sizes : numpy.ndarray, shape (G,)
        Atoms per group.
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
    DiffusionResult
        ``method="vacf"``.
    """
    total = sums.total.cpu().numpy()
    counts = sums.counts.cpu().numpy()
    blocks = sums.blocks.cpu().numpy()
    block_counts = sums.block_counts.cpu().numpy()
    sizes = np.asarray(sizes, dtype=np.float64)
    step_fs = frame_interval / units.fs
    lag_fs = np.arange(total.shape[0], dtype=np.float64) * step_fs
    end = integration_end(lag_fs, integrate_to_fs)
    curves = per_atom_curves(total, counts, sizes)  # (1 + G, W)
    running = cumulative_trapezoid(curves, step_fs) / 3.0
    if len(blocks):
        block_curves = np.stack(
            [per_atom_curves(block, block_counts, sizes) for block in blocks]
        )
        block_values = cumulative_trapezoid(block_curves, step_fs)[..., end] / 3.0
    else:
        block_values = np.zeros((0, curves.shape[0]))
    values = running[:, end]
    errors = [block_standard_error(block_values[:, row]) for row in range(len(values))]
    return DiffusionResult(
        method="vacf",
        label=label,
        lag_fs=lag_fs,
        curve=curves[0],
        curve_by_element=dict(zip(symbols, curves[1:], strict=True)),
        diffusion=float(values[0]),
        diffusion_error=errors[0],
        diffusion_by_element=dict(zip(symbols, values[1:].tolist(), strict=True)),
        diffusion_error_by_element=dict(zip(symbols, errors[1:], strict=True)),
        window_fs=(0.0, float(lag_fs[end])),
        block_diffusion=block_values[:, 0].copy(),
        block_length=int(block_length),
        running_diffusion=running[0],
    )
