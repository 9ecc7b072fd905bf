"""Per-structure time series of a batched run, for plots and analysis.

A :class:`Recorder` attached to an ASE-style dynamics object samples every
``interval`` steps, straight from the batch (one small device-to-host transfer,
no ``Atoms`` copies): potential energy per atom, temperature and pressure for MD;
energy per atom and the largest force for optimizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

import numpy as np
import numpy.typing as npt
import torch
from ase import units

from nvalchemi_ase.dynamics.logs import internal
from nvalchemi_ase.units import (
    ase_time_to_ps,
    pressure_from_stress,
    stress_3x3_to_voigt,
)

if TYPE_CHECKING:
    from pathlib import Path

    from nvalchemi_ase.dynamics.base import BatchedDynamics
    from nvalchemi_ase.plotting import InlinePlot

__all__ = ["Recorder"]


class Recorder:
    """Record per-structure quantities of a run every ``interval`` steps.

    Parameters
    ----------
    dyn : BatchedDynamics
        An ``nvalchemi_ase`` MD or optimizer object (attach before ``run``).
    interval : int
        Sampling interval in steps (ASE's rule; step 0 included).

    Attributes
    ----------
    kind : str
        ``"md"`` or ``"optimization"``.
    """

    def __init__(self, dyn: BatchedDynamics, interval: int = 1) -> None:
        self.dyn = dyn
        self.kind = "optimization" if hasattr(dyn, "fmax_per_structure") else "md"
        self._rows: dict[str, list[Any]] = {}
        self._natoms = np.array([len(atoms) for atoms in dyn.images], dtype=np.float64)
        self._full_cell = np.array([atoms.cell.rank == 3 for atoms in dyn.images])
        dyn.attach(internal(self._sample, needs_stress=self.kind == "md"), interval)

    def as_arrays(self) -> dict[str, npt.NDArray[np.float64]]:
        """Return the recorded series.

        Returns
        -------
        dict of numpy.ndarray
            ``step`` (T,); for MD ``time_ps`` (T,), ``epot_per_atom`` (T, B) eV,
            ``temperature`` (T, B) K and ``pressure_gpa`` (T, B) GPa (NaN for
            structures without a rank-3 cell, or when the model has no stress);
            for optimizers ``epot_per_atom`` (T, B) eV and ``fmax`` (T, B) eV/Å.
        """
        return {key: np.asarray(values) for key, values in self._rows.items()}

    @overload
    def plot(self, path: str | Path, *, title: str | None = ...) -> Path: ...

    @overload
    def plot(self, path: None = ..., *, title: str | None = ...) -> InlinePlot: ...

    def plot(
        self, path: str | Path | None = None, *, title: str | None = None
    ) -> Path | InlinePlot:
        """Draw the series into a PNG, or inline in a notebook without a path.

        See :mod:`nvalchemi_ase.plotting`.

        Parameters
        ----------
        path : str or pathlib.Path, optional
            Output file; None returns an :class:`~nvalchemi_ase.plotting.InlinePlot`
            (a notebook cell ending in ``record.plot()`` shows it).
        title : str, optional
            Figure title.

        Returns
        -------
        pathlib.Path or InlinePlot
            The file written, or the plot.
        """
        from nvalchemi_ase import plotting

        draw = plotting.plot_md if self.kind == "md" else plotting.plot_relaxation
        labels = [
            f"{index}: {atoms.get_chemical_formula()}"
            for index, atoms in enumerate(self.dyn.images)
        ]
        return draw(self.as_arrays(), path, title=title, labels=labels)

    def _append(self, **values: Any) -> None:
        for key, value in values.items():
            self._rows.setdefault(key, []).append(value)

    def _sample(self) -> None:
        dyn = self.dyn
        if self.kind == "optimization":
            self._append(
                step=dyn.nsteps,
                epot_per_atom=dyn.energy_per_structure / self._natoms,  # type: ignore[attr-defined]
                fmax=dyn.fmax_per_structure,  # type: ignore[attr-defined]
            )
            return
        thermo = dyn.per_structure_thermo()
        self._append(
            step=dyn.nsteps,
            time_ps=ase_time_to_ps(dyn.get_time()),  # type: ignore[attr-defined]
            epot_per_atom=thermo["epot"] / thermo["natoms"],
            temperature=thermo["temperature"],
            pressure_gpa=self._pressure_gpa(thermo),
        )

    def _pressure_gpa(self, thermo: dict[str, npt.NDArray[np.float64]]) -> Any:
        """Virial plus ideal-gas pressure per structure, GPa (``include_ideal_gas``)."""
        batch = self.dyn.batch
        count = len(self.dyn.images)
        if "stress" not in batch or self.dyn.stress_step != self.dyn.nsteps:
            return np.full(count, np.nan)
        stress = batch.stress.detach().to(torch.float64)
        volume = torch.linalg.det(batch.cell.detach().to(torch.float64)).abs()
        host = (
            torch.cat([stress.reshape(count, 9), volume[:, None]], dim=1).cpu().numpy()
        )
        virial = pressure_from_stress(
            stress_3x3_to_voigt(host[:, :9].reshape(count, 3, 3))
        )
        kinetic = 2.0 * thermo["ekin"] / (3.0 * host[:, 9])
        pressure = (virial + kinetic) / units.GPa
        return np.where(self._full_cell, pressure, np.nan)
