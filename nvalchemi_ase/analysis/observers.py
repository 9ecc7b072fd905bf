"""Streaming analysis of a batched MD run: observers that keep no frames.

Attach to any of the package's MD classes with ASE's observer protocol::

    dyn = VelocityVerlet(images, 5 * units.fs)
    transport = TransportObserver(dyn, window=200)
    rdf = RDFObserver(dyn, rmax=8.0, nbins=160)
    dyn.attach(transport, interval=2)
    dyn.attach(rdf, interval=20)
    dyn.run(20000)
    msd = transport.msd()            # one DiffusionResult per structure
    vacf = transport.vacf()
    eta = transport.viscosity()      # one ViscosityResult per structure
    g = rdf.result()                 # one RDFResult per structure

Each call reads the batch on its device (no ``Atoms`` copy, no host transfer):
the observers are marked ``needs_atoms = False``, and :class:`TransportObserver`
``needs_stress = True``, so the model computes stress on the steps it samples.
Memory stays fixed as the run grows: :class:`TransportObserver` keeps the last
``window`` samples (ring buffers of unwrapped positions, velocities and traceless
pressures; :class:`~nvalchemi_ase.analysis.correlation.WindowedLagSums`) and
per-lag sums, plus one ``window``-long curve per structure and element for
each completed block; :class:`RDFObserver` keeps one histogram per element pair.

The results equal :func:`~nvalchemi_ase.analysis.msd.mean_squared_displacement`,
:func:`~nvalchemi_ase.analysis.vacf.velocity_autocorrelation`,
:func:`~nvalchemi_ase.analysis.viscosity.shear_viscosity` and
:func:`~nvalchemi_ase.analysis.rdf.radial_distribution` run on a trajectory
written at the same interval (the same ``window`` and ``block_length``). For
variable-cell engines that rotate the cell the batch is in the engine's frame;
MSDs, VACFs, RDFs and the stress sum are unchanged by a fixed rotation.
A structure that fails (``dyn.failures``) stops moving: its results after the
failure step describe a frozen structure.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ase import units

from nvalchemi_ase.analysis._groups import element_groups, subtract_center_of_mass
from nvalchemi_ase.analysis.correlation import LagSums, WindowedLagSums
from nvalchemi_ase.analysis.diffusion import DiffusionResult
from nvalchemi_ase.analysis.msd import einstein_diffusion
from nvalchemi_ase.analysis.rdf import (
    RDFResult,
    check_rmax,
    pair_counts,
    pair_table,
    rdf_from_counts,
)
from nvalchemi_ase.analysis.unwrap import Unwrapper
from nvalchemi_ase.analysis.vacf import green_kubo_diffusion
from nvalchemi_ase.analysis.viscosity import (
    ViscosityResult,
    green_kubo_viscosity,
    kinetic_temperature,
    pressure_tensor,
    traceless_pressure,
)

if TYPE_CHECKING:
    from nvalchemi_ase.dynamics.base import BatchedDynamics

__all__ = ["RDFObserver", "TransportObserver"]


class _BatchObserver:
    """What both observers share: the dynamics, labels, sample steps."""

    needs_atoms = False
    needs_stress = False

    def __init__(self, dyn: BatchedDynamics) -> None:
        if not hasattr(dyn, "batch") or not hasattr(dyn, "images"):
            raise TypeError(
                f"{type(self).__name__} needs an nvalchemi_ase MD object, got "
                f"{type(dyn).__name__}"
            )
        self.dyn = dyn
        self.labels = [
            f"images[{index}] {atoms.get_chemical_formula()}"
            for index, atoms in enumerate(dyn.images)
        ]
        self.steps: list[int] = []

    @property
    def n_samples(self) -> int:
        """Samples taken so far."""
        return len(self.steps)

    def _record_step(self) -> None:
        step = int(self.dyn.nsteps)
        if self.steps and step == self.steps[-1]:
            raise RuntimeError(
                f"{type(self).__name__} was called twice at step {step}; attach it once"
            )
        self.steps.append(step)

    def sample_interval(self) -> float:
        """Time between samples, ASE time units (regular sampling is checked).

        Returns
        -------
        float
            ``dyn.dt × steps between samples``.
        """
        if len(self.steps) < 2:
            raise ValueError(
                f"{type(self).__name__}: fewer than two samples; run longer"
            )
        gaps = np.unique(np.diff(self.steps))
        if gaps.size != 1:
            raise ValueError(
                f"{type(self).__name__}: samples at irregular steps "
                f"(gaps {gaps.tolist()}); attach with one interval and do not "
                "call it by hand"
            )
        return float(self.dyn.dt) * float(gaps[0])  # type: ignore[attr-defined]


class TransportObserver(_BatchObserver):
    """On-the-fly MSD, VACF and stress autocorrelation of every structure.

    Parameters
    ----------
    dyn : BatchedDynamics
        An ``nvalchemi_ase`` MD object (attach with ``dyn.attach(obs, interval=k)``).
    window : int
        Lags kept, in samples (the longest lag is ``(window - 1) × k`` steps).
    block_length : int, optional
        Samples per block of the error estimates (default ``window``).
    remove_drift : bool
        Subtract each structure's centre-of-mass motion from MSD and VACF.
    viscosity : bool or None
        Also correlate the pressure tensor (needs stress from the model and a
        fully periodic cell). None: when the model computes stress and every
        structure is fully periodic.
    """

    def __init__(
        self,
        dyn: BatchedDynamics,
        window: int,
        *,
        block_length: int | None = None,
        remove_drift: bool = True,
        viscosity: bool | None = None,
    ) -> None:
        super().__init__(dyn)
        self.window = int(window)
        self.block_length = int(block_length or window)
        self.remove_drift = remove_drift
        batch = dyn.batch
        device = batch.positions.device
        self._numbers = [atoms.numbers.copy() for atoms in dyn.images]
        self.groups = element_groups(self._numbers, device=device)
        self._count = len(dyn.images)
        self._masses = batch.atomic_masses.detach().to(torch.float64).reshape(-1)
        self._atom_structure = batch.batch_idx.long()
        pbc = batch.pbc.to(torch.bool)
        self._unwrap = Unwrapper(pbc, self._atom_structure)
        self._msd = WindowedLagSums(
            self.groups.of_atom, self.groups.count, window, self.block_length, "msd"
        )
        self._vacf = WindowedLagSums(
            self.groups.of_atom, self.groups.count, window, self.block_length, "product"
        )
        stress_ok = "stress" in set(dyn.model.model_config.outputs)
        periodic = bool(pbc.all())
        if viscosity is None:
            viscosity = stress_ok and periodic
        if viscosity and not (stress_ok and periodic):
            raise ValueError(
                "viscosity=True needs a model that computes stress and fully "
                "periodic structures"
            )
        self.needs_stress = bool(viscosity)
        self._stress: WindowedLagSums | None = None
        if viscosity:
            self._stress = WindowedLagSums(
                torch.arange(self._count, device=device),
                self._count,
                window,
                self.block_length,
                "product",
            )
        zeros = torch.zeros(self._count, dtype=torch.float64, device=device)
        self._volume_sum = zeros
        self._temperature_sum = zeros.clone()

    def __call__(self) -> None:
        """Take one sample of every structure (ASE calls this at the interval)."""
        self._record_step()
        batch = self.dyn.batch
        with torch.no_grad():
            cells = batch.cell.detach().to(torch.float64)
            positions = self._unwrap.update(batch.positions, cells)
            velocities = batch.velocities.detach().to(torch.float64)
            if self.remove_drift:
                positions = self._drift_free(positions)
                moving = self._drift_free(velocities)
            else:
                moving = velocities
            self._msd.update(positions)
            self._vacf.update(moving * units.fs)  # Å/fs
            if self._stress is not None:
                self._sample_stress(batch, cells, velocities)

    def _drift_free(self, values: torch.Tensor) -> torch.Tensor:
        return subtract_center_of_mass(
            values, self._masses, self._atom_structure, self._count
        )

    def _sample_stress(
        self, batch: Any, cells: torch.Tensor, velocities: torch.Tensor
    ) -> None:
        if self._stress is None:
            return
        if "stress" not in batch:
            raise RuntimeError(
                "TransportObserver: the batch holds no stress at step "
                f"{self.dyn.nsteps}; attach it with dyn.attach (not by hand)"
            )
        volume = torch.linalg.det(cells).abs()
        pressure = pressure_tensor(
            batch.stress.detach().to(torch.float64).reshape(-1, 3, 3),
            velocities,
            self._masses,
            volume,
            self._atom_structure,
            self._count,
        )
        self._stress.update(traceless_pressure(pressure)[:, None, :].reshape(-1, 9))
        self._volume_sum += volume
        self._temperature_sum += kinetic_temperature(
            velocities, self._masses, self._atom_structure, self._count
        )

    def msd(
        self, *, fit_window_fs: tuple[float, float] | None = None
    ) -> list[DiffusionResult]:
        """MSD and Einstein D of every structure so far.

        Parameters
        ----------
        fit_window_fs : tuple of float, optional
            Fit range, fs (default: 20–80 % of the largest lag).

        Returns
        -------
        list of DiffusionResult
            One per structure (``method="msd"``), as
            :func:`~nvalchemi_ase.analysis.msd.mean_squared_displacement`.
        """
        return self._per_structure(
            self._msd.result(),
            partial(einstein_diffusion, fit_window_fs=fit_window_fs),
        )

    def vacf(self, *, integrate_to_fs: float | None = None) -> list[DiffusionResult]:
        """VACF and Green–Kubo D of every structure so far.

        Parameters
        ----------
        integrate_to_fs : float, optional
            Upper limit of the integral, fs (default: the largest lag).

        Returns
        -------
        list of DiffusionResult
            One per structure (``method="vacf"``), as
            :func:`~nvalchemi_ase.analysis.vacf.velocity_autocorrelation`.
        """
        return self._per_structure(
            self._vacf.result(),
            partial(green_kubo_diffusion, integrate_to_fs=integrate_to_fs),
        )

    def _per_structure(
        self, sums: LagSums, estimate: Callable[..., DiffusionResult]
    ) -> list[DiffusionResult]:
        """``estimate`` on each structure's element groups of ``sums``."""
        interval = self.sample_interval()
        return [
            estimate(
                sums.select(torch.as_tensor(groups, device=sums.total.device)),
                [self.groups.symbol[g] for g in groups],
                self.groups.size[groups],
                interval,
                self.block_length,
                label=label,
            )
            for groups, label in self._structure_groups()
        ]

    def viscosity(
        self,
        *,
        integrate_to_fs: float | None = None,
        temperature_K: float | None = None,
    ) -> list[ViscosityResult]:
        """Green–Kubo shear viscosity of every structure so far.

        Parameters
        ----------
        integrate_to_fs : float, optional
            Upper limit of the integral, fs (default: the largest lag).
        temperature_K : float, optional
            Temperature in ``V/(kB T)``, K (default: each structure's mean
            kinetic temperature ``2 E_kin / (3 N kB)`` over the samples).

        Returns
        -------
        list of ViscosityResult
            One per structure, as
            :func:`~nvalchemi_ase.analysis.viscosity.shear_viscosity`.
        """
        if self._stress is None:
            raise ValueError(
                "TransportObserver was built without viscosity (the model has no "
                "stress or a structure is not fully periodic)"
            )
        sums = self._stress.result()
        interval = self.sample_interval()
        samples = float(self._stress.n_samples)
        volumes = (self._volume_sum / samples).cpu().numpy()
        temperatures = (self._temperature_sum / samples).cpu().numpy()
        return [
            green_kubo_viscosity(
                sums.select(torch.tensor([index], device=sums.total.device)),
                float(volumes[index]),
                float(temperatures[index] if temperature_K is None else temperature_K),
                interval,
                self.block_length,
                label=label,
                integrate_to_fs=integrate_to_fs,
            )
            for index, label in enumerate(self.labels)
        ]

    def _structure_groups(self) -> list[tuple[np.ndarray, str]]:
        return [
            (self.groups.of_structure(index), label)
            for index, label in enumerate(self.labels)
        ]


class RDFObserver(_BatchObserver):
    """On-the-fly total and partial RDFs of every structure.

    Parameters
    ----------
    dyn : BatchedDynamics
        An ``nvalchemi_ase`` MD object (attach with ``dyn.attach(obs, interval=k)``).
    rmax : float
        Largest distance, Å (at most half the smallest periodic cell width of
        every structure; checked now and, for a changing cell, at the end).
    nbins : int
        Number of bins.
    """

    def __init__(self, dyn: BatchedDynamics, rmax: float, nbins: int) -> None:
        super().__init__(dyn)
        if int(nbins) != nbins or nbins < 1:
            raise ValueError(f"nbins must be a positive integer, got {nbins}")
        self.rmax = float(rmax)
        self.nbins = int(nbins)
        for index, atoms in enumerate(dyn.images):
            if atoms.cell.rank != 3:
                raise ValueError(
                    f"images[{index}]: the RDF needs a cell with three lattice "
                    "vectors (its volume sets the density)"
                )
            check_rmax(atoms.cell.array[None], atoms.pbc, self.rmax, f"images[{index}]")
        batch = dyn.batch
        device = batch.positions.device
        self.table = pair_table([atoms.numbers for atoms in dyn.images], device=device)
        self._pbc = batch.pbc.to(torch.bool)
        self._counts = torch.zeros(
            len(self.table.elements), self.nbins, dtype=torch.float64, device=device
        )
        self._smallest_width = torch.full(
            (len(dyn.images),), float("inf"), dtype=torch.float64, device=device
        )

    def __call__(self) -> None:
        """Histogram the pair distances of every structure (one sample)."""
        self._record_step()
        batch = self.dyn.batch
        table = self.table
        with torch.no_grad():
            positions = batch.positions.detach().to(torch.float64)
            cells = batch.cell.detach().to(torch.float64)
            volume = torch.linalg.det(cells).abs()
            self._track_widths(cells, volume)
            self._counts += pair_counts(
                positions[table.second] - positions[table.first],
                cells[table.structure],
                self._pbc[table.structure],
                table.kind,
                volume[table.structure],
                len(table.elements),
                self.rmax,
                self.nbins,
            )

    def _track_widths(self, cells: torch.Tensor, volume: torch.Tensor) -> None:
        cross = torch.linalg.cross(cells.roll(-1, dims=1), cells.roll(-2, dims=1))
        widths = volume[:, None] / torch.linalg.vector_norm(cross, dim=-1)
        widths = torch.where(self._pbc, widths, torch.full_like(widths, float("inf")))
        self._smallest_width = torch.minimum(
            self._smallest_width, widths.min(dim=1).values
        )

    def result(self) -> list[RDFResult]:
        """RDFs of every structure averaged over the samples so far.

        Returns
        -------
        list of RDFResult
            One per structure, as
            :func:`~nvalchemi_ase.analysis.rdf.radial_distribution`.
        """
        if not self.steps:
            raise ValueError("RDFObserver: no samples yet; run the dynamics first")
        widths = self._smallest_width.cpu().numpy()
        for index, width in enumerate(widths):
            if width < 2 * self.rmax:
                raise ValueError(
                    f"images[{index}]: the cell shrank to a width of {width:.3f} Å "
                    f"during the run, less than 2*rmax={2 * self.rmax:g} Å"
                )
        count = len(self.dyn.images)
        return rdf_from_counts(
            self._counts.cpu().numpy(),
            self.table,
            np.full(count, float(len(self.steps))),
            self.rmax,
            self.nbins,
            self.labels,
        )
