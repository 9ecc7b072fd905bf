"""Mean squared displacement per structure and the Einstein self-diffusion coefficient.

``MSD(t) = <|u_i(t0 + t) - u_i(t0)|²>`` averaged over the atoms (of the
structure, or of one element) and over every time origin ``t0``, with ``u`` the
unwrapped positions (:mod:`~nvalchemi_ase.analysis.unwrap`) and, by default, each
structure's centre-of-mass drift removed. In three dimensions
``MSD(t) → 6 D t + c`` once motion is diffusive, so ``D = slope / 6``, fitted by
least squares over ``fit_window_fs`` (default: the middle 20–80 % of the lag
range, skipping the ballistic start and the noisy end; the last two lags
when that range holds fewer). Since ``dMSD/dt = 6 D_GK(t)``, the running
Green–Kubo integral of :mod:`~nvalchemi_ase.analysis.vacf`, a fit over lags
where that integral still overshoots (dense liquids: below ~0.5 ps) biases D
high: start the fit where ``running_diffusion`` is flat. Uncertainty: block
standard error (:mod:`~nvalchemi_ase.analysis.diffusion`).

Units: positions Å, time between frames ASE time units in, lag times fs out,
MSD Å², D Å²/fs (``DiffusionResult.diffusion_cm2_s`` for cm²/s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
from nvalchemi_ase.analysis.frames import Frames, FramesLike, load_trajectories
from nvalchemi_ase.analysis.unwrap import unwrap_positions

__all__ = [
    "DEFAULT_FIT_FRACTIONS",
    "diffusion_of_each",
    "einstein_diffusion",
    "mean_squared_displacement",
    "resolve_lengths",
]

FloatArray = npt.NDArray[np.float64]

#: Default MSD fit range, as fractions of the largest lag.
DEFAULT_FIT_FRACTIONS = (0.2, 0.8)


def resolve_lengths(
    n_samples: int, window: int | None, block_length: int | None
) -> tuple[int, int]:
    """Default lag window and block length for a series of ``n_samples``.

    Parameters
    ----------
    n_samples : int
        Samples in the series T.
    window : int or None
        Lags W; default: the block length.
    block_length : int or None
        Samples per block; default ``T // 5`` (five blocks), at least 2.

    Returns
    -------
    tuple of int
        ``(window, block_length)``.
    """
    if block_length is None:
        block_length = max(n_samples // 5, min(2, n_samples))
        if window is not None:
            block_length = max(block_length, min(int(window), n_samples))
    if window is None:
        window = block_length
    return int(window), int(block_length)


def mean_squared_displacement(
    trajectories: Sequence[FramesLike],
    frame_interval: float | Sequence[float | None] | None = None,
    *,
    window: int | None = None,
    block_length: int | None = None,
    fit_window_fs: tuple[float, float] | None = None,
    remove_drift: bool = True,
) -> list[DiffusionResult]:
    """MSD and Einstein D of every structure, from its frames.

    Parameters
    ----------
    trajectories : sequence of (path, list of Atoms, or Frames)
        One entry per structure (see
        :func:`~nvalchemi_ase.analysis.frames.load_trajectories`).
    frame_interval : float, sequence of float, or None
        Time between frames, ASE time units (None: from each ``.traj`` header).
    window : int, optional
        Lags computed, in frames (default: ``block_length``).
    block_length : int, optional
        Frames per block of the error estimate (default: a fifth of the run).
    fit_window_fs : tuple of float, optional
        Lag range of the linear fit, fs (default: 20–80 % of the largest lag).
    remove_drift : bool
        Subtract each structure's centre-of-mass displacement first.

    Returns
    -------
    list of DiffusionResult
        One per structure, in input order (``method="msd"``).
    """
    return diffusion_of_each(
        trajectories,
        frame_interval,
        window,
        block_length,
        lambda index, frames, lags, blocks: _msd_sums(
            frames, lags, blocks, remove_drift
        ),
        partial(einstein_diffusion, fit_window_fs=fit_window_fs),
    )


def diffusion_of_each(
    trajectories: Sequence[FramesLike],
    frame_interval: float | Sequence[float | None] | None,
    window: int | None,
    block_length: int | None,
    sums_of: Callable[[int, Frames, int, int], LagSums],
    estimate: Callable[..., DiffusionResult],
) -> list[DiffusionResult]:
    """D of every structure: its lag sums, then its estimate with block errors.

    Parameters
    ----------
    trajectories, frame_interval, window, block_length
        As :func:`mean_squared_displacement`.
    sums_of : callable
        ``(index, frames, window, block_length) -> LagSums`` of one structure's
        element groups.
    estimate : callable
        ``(sums, symbols, sizes, frame_interval, block_length, label=)`` ->
        DiffusionResult (:func:`einstein_diffusion`, Green–Kubo's).

    Returns
    -------
    list of DiffusionResult
        One per structure, in input order.
    """
    results = []
    for index, frames in enumerate(load_trajectories(trajectories, frame_interval)):
        lags, blocks = resolve_lengths(frames.n_frames, window, block_length)
        sums = sums_of(index, frames, lags, blocks)
        groups = element_groups([frames.numbers])
        results.append(
            estimate(
                sums,
                groups.symbol,
                groups.size,
                frames.frame_interval,
                blocks,
                label=frames.label,
            )
        )
    return results


def _msd_sums(
    frames: Frames, window: int, block_length: int, remove_drift: bool
) -> LagSums:
    groups = element_groups([frames.numbers])
    positions = unwrap_positions(
        torch.as_tensor(frames.positions),
        torch.as_tensor(frames.cells),
        torch.as_tensor(frames.pbc),
    )
    if remove_drift:
        positions = subtract_center_of_mass(
            positions, torch.as_tensor(frames.masses), groups.structure_of_atom, 1
        )
    return lag_sums(
        positions, groups.of_atom, groups.count, window, block_length, "msd"
    )


def einstein_diffusion(
    sums: LagSums,
    symbols: Sequence[str],
    sizes: FloatArray,
    frame_interval: float,
    block_length: int,
    *,
    label: str,
    fit_window_fs: tuple[float, float] | None = None,
) -> DiffusionResult:
    """Turn one structure's MSD sums into its MSD curves and D.

    Parameters
    ----------
    sums : LagSums
        ``"msd"`` sums of the structure's element groups (G columns).
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
    fit_window_fs : tuple of float, optional
        Fit range, fs (default :data:`DEFAULT_FIT_FRACTIONS` of the largest lag).

    Returns
    -------
    DiffusionResult
        ``method="msd"``.
    """
    total = sums.total.cpu().numpy()
    counts = sums.counts.cpu().numpy()
    blocks = sums.blocks.cpu().numpy()
    block_counts = sums.block_counts.cpu().numpy()
    sizes = np.asarray(sizes, dtype=np.float64)
    lag_fs = np.arange(total.shape[0], dtype=np.float64) * (frame_interval / units.fs)
    fit = _fit_mask(lag_fs, fit_window_fs)
    # rows: all atoms, then each element; for the whole run and per block
    curves = per_atom_curves(total, counts, sizes)  # (1 + G, W)
    block_curves = (
        np.stack([per_atom_curves(block, block_counts, sizes) for block in blocks])
        if len(blocks)
        else np.zeros((0, *curves.shape))
    )
    slopes = _slopes(lag_fs[fit], curves[:, fit]) / 6.0
    block_slopes = _slopes(lag_fs[fit], block_curves[..., fit]) / 6.0  # (nb, 1+G)
    errors = [block_standard_error(block_slopes[:, row]) for row in range(len(slopes))]
    return DiffusionResult(
        method="msd",
        label=label,
        lag_fs=lag_fs,
        curve=curves[0],
        curve_by_element=dict(zip(symbols, curves[1:], strict=True)),
        diffusion=float(slopes[0]),
        diffusion_error=errors[0],
        diffusion_by_element=dict(zip(symbols, slopes[1:].tolist(), strict=True)),
        diffusion_error_by_element=dict(zip(symbols, errors[1:], strict=True)),
        window_fs=(float(lag_fs[fit][0]), float(lag_fs[fit][-1])),
        block_diffusion=block_slopes[:, 0].copy(),
        block_length=int(block_length),
    )


def _fit_mask(
    lag_fs: FloatArray, fit_window_fs: tuple[float, float] | None
) -> npt.NDArray[np.bool_]:
    if fit_window_fs is None:
        start, end = (f * lag_fs[-1] for f in DEFAULT_FIT_FRACTIONS)
    else:
        start, end = (float(v) for v in fit_window_fs)
        if not start < end:
            raise ValueError(f"fit_window_fs must be (start, end), got {fit_window_fs}")
    mask = (lag_fs >= start - 1e-9) & (lag_fs <= end + 1e-9)
    if fit_window_fs is None and mask.sum() < 2:  # a short window: the last lags
        mask = np.arange(lag_fs.size) >= max(lag_fs.size - 2, 0)
    if mask.sum() < 2:
        raise ValueError(
            f"the MSD fit window ({start:g}, {end:g}) fs holds {int(mask.sum())} "
            f"lags of 0 .. {lag_fs[-1]:g} fs; widen fit_window_fs or the window"
        )
    return mask


def _slopes(times: FloatArray, values: FloatArray) -> FloatArray:
    """Least-squares slopes of ``values[..., :]`` against ``times``."""
    centered = times - times.mean()
    return (values * centered).sum(axis=-1) / (centered * centered).sum()
