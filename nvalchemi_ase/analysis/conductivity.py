"""Nernst–Einstein ionic conductivity from per-element self-diffusion.

For each structure,

    σ_NE = e² / (V k_B T) · Σ_a N_a z_a² D_a

with N_a the number of atoms of element a, z_a its charge (in units of the
elementary charge e), D_a its self-diffusion coefficient, V the volume and T
the temperature. It neglects the cross-correlations of different ions'
displacements (Haven ratio 1), so it is an estimate of the conductivity the
full (collective) Green–Kubo or Einstein expression gives. Units: D from a
:class:`~nvalchemi_ase.analysis.diffusion.DiffusionResult` in Å²/fs, V in Å³,
T in K, charges in e; σ in S/m (1 S/m = 10 mS/cm). The constants are the SI's
exact ones (e = 1.602176634e-19 C, k_B = 1.380649e-23 J/K).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from ase import Atoms

from nvalchemi_ase.analysis.diffusion import DiffusionResult

__all__ = [
    "BOLTZMANN_J_PER_K",
    "ELEMENTARY_CHARGE_C",
    "ConductivityResult",
    "nernst_einstein_conductivity",
]

#: Elementary charge, C (exact in the SI since 2019).
ELEMENTARY_CHARGE_C = 1.602176634e-19
#: Boltzmann constant, J/K (exact in the SI since 2019).
BOLTZMANN_J_PER_K = 1.380649e-23
#: 1 Å²/fs in m²/s.
_A2_PER_FS_TO_M2_PER_S = 1e-5
#: 1 Å³ in m³.
_A3_TO_M3 = 1e-30


@dataclass(frozen=True)
class ConductivityResult:
    """Nernst–Einstein conductivity of one structure.

    Attributes
    ----------
    label : str
        The structure (the diffusion result's label).
    conductivity : float
        σ_NE, S/m.
    conductivity_error : float
        Its error, S/m, from the elements' block errors of D taken as
        independent.
    contribution_by_element : dict of str to float
        Each element's term ``e² N_a z_a² D_a / (V k_B T)``, S/m.
    charges : dict of str to float
        The charge used for each element, e.
    counts : dict of str to int
        Atoms of each element.
    volume : float
        V, Å³.
    temperature_K : float
        T, K.
    """

    label: str
    conductivity: float
    conductivity_error: float
    contribution_by_element: dict[str, float]
    charges: dict[str, float]
    counts: dict[str, int]
    volume: float
    temperature_K: float

    @property
    def conductivity_mS_cm(self) -> float:  # noqa: N802 - the unit's spelling
        """σ_NE in mS/cm (10 × the value in S/m)."""
        return 10.0 * self.conductivity

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form for JSON, units in the keys."""
        return {
            "label": self.label,
            "conductivity_S_per_m": self.conductivity,
            "conductivity_error_S_per_m": self.conductivity_error,
            "contribution_by_element_S_per_m": dict(self.contribution_by_element),
            "charges_e": dict(self.charges),
            "counts": dict(self.counts),
            "volume_A3": self.volume,
            "temperature_K": self.temperature_K,
        }


def nernst_einstein_conductivity(
    diffusion: Sequence[DiffusionResult],
    structures: Sequence[Atoms],
    charges: Mapping[str, float] | Sequence[Mapping[str, float]],
    temperature_K: float | Sequence[float],
    *,
    volume: float | Sequence[float] | None = None,
) -> list[ConductivityResult]:
    """Nernst–Einstein ionic conductivity of every structure, S/m.

    Parameters
    ----------
    diffusion : sequence of DiffusionResult
        One per structure (from
        :func:`~nvalchemi_ase.analysis.mean_squared_displacement` or
        :func:`~nvalchemi_ase.analysis.velocity_autocorrelation`); each
        element's D (Å²/fs) and block error are used.
    structures : sequence of ase.Atoms
        One per structure (e.g. the first frame): the atoms of each element
        and, without ``volume``, the cell volume.
    charges : mapping of str to float, or one mapping per structure
        Charge of each element, in e (formal charges, e.g.
        ``{"Li": 1, "Cl": -1}``); every element present needs one (0 for a
        neutral species).
    temperature_K : float or sequence of float
        T, K (the run's target or its mean kinetic temperature), shared or
        one per structure.
    volume : float or sequence of float, optional
        V, Å³ (e.g. the mean volume of an NPT run); default each structure's
        cell volume.

    Returns
    -------
    list of ConductivityResult
        One per structure, in input order.

    Raises
    ------
    ValueError
        Naming the structure and the field: mismatched lengths, an element
        without a charge or a diffusion coefficient, a non-positive T or V.
    """
    count = len(diffusion)
    if len(structures) != count:
        raise ValueError(
            f"got {count} diffusion results but {len(structures)} structures; give "
            "one structure per result"
        )
    per_charges = _per_structure_charges(charges, count)
    temperatures = _per_structure_values("temperature_K", temperature_K, count)
    volumes = (
        np.array([_cell_volume(atoms, index) for index, atoms in enumerate(structures)])
        if volume is None
        else _per_structure_values("volume", volume, count)
    )
    return [
        _one(
            result,
            atoms,
            per_charges[index],
            temperatures[index],
            volumes[index],
            index,
        )
        for index, (result, atoms) in enumerate(zip(diffusion, structures, strict=True))
    ]


def _one(
    result: DiffusionResult,
    atoms: Atoms,
    charges: Mapping[str, float],
    temperature_K: float,
    volume: float,
    index: int,
) -> ConductivityResult:
    symbols, counts = np.unique(atoms.get_chemical_symbols(), return_counts=True)
    prefactor = ELEMENTARY_CHARGE_C**2 / (
        volume * _A3_TO_M3 * BOLTZMANN_J_PER_K * temperature_K
    )
    contributions, variances = {}, []
    for symbol, number in zip(symbols.tolist(), counts.tolist(), strict=True):
        if symbol not in charges:
            raise ValueError(
                f"structures[{index}] has {symbol} but charges has none for it; "
                f"give charges[{symbol!r}] in e (0 for a neutral species)"
            )
        if symbol not in result.diffusion_by_element:
            raise ValueError(
                f"diffusion[{index}] ({result.label}) has no D for {symbol}; it "
                f"was computed for other atoms than structures[{index}]"
            )
        weight = prefactor * number * float(charges[symbol]) ** 2
        to_si = weight * _A2_PER_FS_TO_M2_PER_S
        contributions[symbol] = to_si * result.diffusion_by_element[symbol]
        variances.append((to_si * result.diffusion_error_by_element[symbol]) ** 2)
    return ConductivityResult(
        label=result.label,
        conductivity=float(sum(contributions.values())),
        conductivity_error=float(np.sqrt(sum(variances))),
        contribution_by_element=contributions,
        charges={symbol: float(charges[symbol]) for symbol in contributions},
        counts=dict(zip(symbols.tolist(), counts.tolist(), strict=True)),
        volume=float(volume),
        temperature_K=float(temperature_K),
    )


def _per_structure_charges(
    charges: Mapping[str, float] | Sequence[Mapping[str, float]], count: int
) -> list[Mapping[str, float]]:
    if isinstance(charges, Mapping):
        return [charges] * count
    listed = list(charges)
    if len(listed) != count:
        raise ValueError(
            f"charges has {len(listed)} mappings for {count} structures; give one "
            "mapping (shared) or one per structure"
        )
    return listed


def _per_structure_values(
    name: str, value: float | Sequence[float], count: int
) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        array = np.full(count, float(array))
    if array.shape != (count,):
        raise ValueError(
            f"{name} has shape {array.shape}; give one value or one per structure "
            f"({count})"
        )
    bad = ~np.isfinite(array) | (array <= 0)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} for structures[{index}] is {array[index]}; it must be positive"
        )
    return array


def _cell_volume(atoms: Atoms, index: int) -> float:
    if atoms.cell.rank < 3:
        raise ValueError(
            f"structures[{index}] has no 3-D cell; give volume= (Å³) for it"
        )
    return float(atoms.get_volume())
