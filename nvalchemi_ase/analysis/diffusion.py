"""What a self-diffusion analysis returns, and its block-averaged uncertainty.

Both estimates of the self-diffusion coefficient D (Einstein, from the mean
squared displacement, :mod:`~nvalchemi_ase.analysis.msd`; Green–Kubo, from the
velocity autocorrelation function, :mod:`~nvalchemi_ase.analysis.vacf`) return a
:class:`DiffusionResult` per structure. The uncertainty is the **standard error
of block estimates**: the run is cut into ``n_blocks`` consecutive blocks of
``block_length`` samples, D is estimated in each from the sample pairs inside it
alone, and ``error = std(D_blocks, ddof=1) / sqrt(n_blocks)`` (NaN with fewer
than two blocks). Blocks longer than the correlation time make the block
estimates nearly independent, so this error is honest where the fit's own
standard error (correlated MSD points) is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.analysis.conversions import diffusion_a2_per_fs_to_cm2_per_s

__all__ = ["DiffusionResult", "block_standard_error", "per_atom_curves"]

FloatArray = npt.NDArray[np.float64]


def block_standard_error(values: FloatArray) -> float:
    """Return the standard error of the mean of block estimates.

    Parameters
    ----------
    values : numpy.ndarray, shape (n_blocks,)
        One estimate per block.

    Returns
    -------
    float
        ``std(values, ddof=1) / sqrt(n_blocks)``; NaN for fewer than 2 blocks.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        return float("nan")
    return float(np.std(values, ddof=1) / np.sqrt(values.size))


@dataclass(frozen=True)
class DiffusionResult:
    """Self-diffusion of one structure.

    Attributes
    ----------
    method : {"msd", "vacf"}
        Einstein (MSD slope) or Green–Kubo (VACF integral).
    label : str
        The structure (its file, or ``trajectories[i]`` / ``images[i]``).
    lag_fs : numpy.ndarray, shape (W,)
        Lag times, fs.
    curve : numpy.ndarray, shape (W,)
        Per-atom average over all atoms and time origins: the MSD in Å², or the
        VACF ``<v(0)·v(t)>`` in Å²/fs².
    curve_by_element : dict of str to numpy.ndarray, shape (W,)
        The same over each element's atoms.
    diffusion : float
        D, Å²/fs (all atoms).
    diffusion_error : float
        Block standard error of D, Å²/fs (see the module docstring).
    diffusion_by_element : dict of str to float
        D of each element, Å²/fs.
    diffusion_error_by_element : dict of str to float
        Its block standard error, Å²/fs.
    window_fs : tuple of float
        The lag range used: the fitted range for ``"msd"``, the integration
        range ``(0, end)`` for ``"vacf"``, fs.
    block_diffusion : numpy.ndarray, shape (n_blocks,)
        D of each block, Å²/fs.
    block_length : int
        Samples per block.
    running_diffusion : numpy.ndarray, shape (W,) or None
        For ``"vacf"``: ``(1/3) ∫_0^t VACF dt'`` at every lag, Å²/fs.
    """

    method: Literal["msd", "vacf"]
    label: str
    lag_fs: FloatArray
    curve: FloatArray
    curve_by_element: dict[str, FloatArray]
    diffusion: float
    diffusion_error: float
    diffusion_by_element: dict[str, float]
    diffusion_error_by_element: dict[str, float]
    window_fs: tuple[float, float]
    block_diffusion: FloatArray
    block_length: int
    running_diffusion: FloatArray | None = field(default=None)

    @property
    def diffusion_cm2_s(self) -> float:
        """D in cm²/s."""
        return float(diffusion_a2_per_fs_to_cm2_per_s(self.diffusion))

    @property
    def diffusion_error_cm2_s(self) -> float:
        """Block standard error of D in cm²/s."""
        return float(diffusion_a2_per_fs_to_cm2_per_s(self.diffusion_error))

    @property
    def n_blocks(self) -> int:
        """Number of complete blocks."""
        return int(self.block_diffusion.size)

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form for JSON (NaN becomes None), units in the keys.

        Returns
        -------
        dict
            Every field, arrays as lists.
        """
        curve_name = "msd_A2" if self.method == "msd" else "vacf_A2_per_fs2"
        data: dict[str, Any] = {
            "method": self.method,
            "label": self.label,
            "diffusion_A2_per_fs": _number(self.diffusion),
            "diffusion_error_A2_per_fs": _number(self.diffusion_error),
            "diffusion_cm2_per_s": _number(self.diffusion_cm2_s),
            "diffusion_error_cm2_per_s": _number(self.diffusion_error_cm2_s),
            "diffusion_by_element_A2_per_fs": {
                k: _number(v) for k, v in self.diffusion_by_element.items()
            },
            "diffusion_error_by_element_A2_per_fs": {
                k: _number(v) for k, v in self.diffusion_error_by_element.items()
            },
            "window_fs": list(self.window_fs),
            "n_blocks": self.n_blocks,
            "block_length": self.block_length,
            "block_diffusion_A2_per_fs": [_number(v) for v in self.block_diffusion],
            "lag_fs": self.lag_fs.tolist(),
            curve_name: [_number(v) for v in self.curve],
            f"{curve_name}_by_element": {
                k: [_number(x) for x in v] for k, v in self.curve_by_element.items()
            },
        }
        if self.running_diffusion is not None:
            data["running_diffusion_A2_per_fs"] = [
                _number(v) for v in self.running_diffusion
            ]
        return data


def per_atom_curves(
    sums: FloatArray, counts: FloatArray, sizes: FloatArray
) -> FloatArray:
    """Per-atom averages over origins: all atoms, then each group.

    Parameters
    ----------
    sums : numpy.ndarray, shape (W, G)
        Lag sums of a structure's groups.
    counts : numpy.ndarray, shape (W,)
        Origins per lag.
    sizes : numpy.ndarray, shape (G,)
        Atoms per group.

    Returns
    -------
    numpy.ndarray, shape (1 + G, W)
        Row 0 over all atoms, row 1 + g over group g.
    """
    everything = sums.sum(axis=1) / (counts * sizes.sum())
    per_group = sums / (counts[:, None] * sizes[None, :])
    return np.concatenate([everything[None], per_group.T])


def _number(value: float) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None
