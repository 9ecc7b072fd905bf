"""Equations of state of many materials at once.

Every material is scaled to ``n_volumes`` cells (lattice vectors times
``1 - strain`` ... ``1 + strain``); all scaled cells of all materials are
evaluated in one batched call, or first relaxed (ions at fixed cell: one
in-flight run, :func:`nvalchemi_ase.runners.relax`, that each cell leaves as
it converges; shape at fixed volume: one batched optimizer run). ASE's
:class:`ase.eos.EquationOfState` fits each material's E(V).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from ase import Atoms, units
from ase.calculators.singlepoint import SinglePointCalculator
from ase.eos import EquationOfState, eos_names

from nvalchemi_ase.io_safe import write_frames
from nvalchemi_ase.properties._common import (
    FIXED_CELL_OPTIMIZERS,
    VARIABLE_CELL_OPTIMIZERS,
    Derived,
    Ledger,
    MaterialResult,
    evaluate,
    evaluate_or_relax,
    gather,
    prepared_materials,
    relax_structures,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["EOSResult", "equation_of_state"]

#: What can relax at each volume.
RelaxMode = Literal["ions", "shape"] | None


@dataclass
class EOSResult(MaterialResult):
    """Equation of state of one material.

    Attributes
    ----------
    volumes : numpy.ndarray, shape (n_volumes,)
        Cell volumes, Å³.
    energies : numpy.ndarray, shape (n_volumes,)
        Energies at those volumes (after relaxation with ``relax="ions"``), eV.
    v0 : float
        Fitted equilibrium volume, Å³.
    e0 : float
        Fitted minimum energy, eV.
    B : float
        Fitted bulk modulus, GPa.
    eos : str
        ASE's name of the fitted form (e.g. ``"birchmurnaghan"``).
    relax : str or None
        What was relaxed at each volume (None or ``"ions"``).
    relax_first : bool
        Whether cell and ions were relaxed before scaling.
    reference_cell : numpy.ndarray, shape (3, 3)
        Cell that was scaled (rows are lattice vectors), Å.
    cell0 : numpy.ndarray, shape (3, 3)
        ``reference_cell`` scaled isotropically to ``v0``, Å (its row lengths
        are the lattice constants at the minimum).
    relax_steps : numpy.ndarray of int, shape (n_volumes,)
        Optimizer steps each volume took to converge (0: its forces were
        already below ``fmax``; -1 without relaxation).
    fit : ase.eos.EquationOfState
        ASE's fitted object (``fit.getplotdata()``, ``fit.plot()``); not
        written to JSON.
    frames : list of ase.Atoms
        The scaled cells in volume order (positions relaxed with ``relax``),
        each with its energy (and, after an ion relaxation, forces) on a
        ``SinglePointCalculator``; :meth:`write` saves them as one
        multi-frame file, which ``ase gui``'s *Tools → Bulk modulus* reads.
        Not written to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "volumes": "Å^3",
        "energies": "eV",
        "v0": "Å^3",
        "e0": "eV",
        "B": "GPa",
        "reference_cell": "Å",
        "cell0": "Å",
    }

    volumes: np.ndarray | None = None
    energies: np.ndarray | None = None
    v0: float | None = None
    e0: float | None = None
    B: float | None = None
    eos: str = "birchmurnaghan"
    relax: str | None = None
    relax_first: bool = False
    reference_cell: np.ndarray | None = None
    cell0: np.ndarray | None = None
    relax_steps: np.ndarray | None = None
    fit: EquationOfState | None = field(
        default=None, repr=False, metadata={"json": False}
    )
    frames: list[Atoms] | None = field(
        default=None, repr=False, metadata={"json": False}
    )

    def write(
        self, filename: str | os.PathLike[str], format: str | None = None
    ) -> None:
        """Write the scan as one multi-frame file (e.g. ``"Cu-eos.extxyz"``).

        Every frame carries its cell, positions and energy (eV), so
        ``ase gui Cu-eos.extxyz`` → *Tools → Bulk modulus* fits the same
        E(V) as this result.

        Parameters
        ----------
        filename : str or path
            Where to write; the format follows the name unless given.
        format : str, optional
            ASE's format name (``"extxyz"``, ``"traj"``, ...).

        Raises
        ------
        ValueError
            For a failed material (it has no frames).
        """
        if not self.frames:
            raise ValueError(
                f"material {self.index} ({self.formula}) has no EOS frames to "
                f"write: {self.error or 'it was not computed'}"
            )
        write_frames(os.fspath(filename), self.frames, format=format)


def equation_of_state(
    images: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    n_volumes: int = 7,
    strain: float = 0.05,
    relax: RelaxMode = None,
    eos: str = "birchmurnaghan",
    fmax: float = 0.01,
    steps: int = 1000,
    optimizer: str = "FIRE",
    relax_first: bool = False,
    cell_optimizer: str = "FIRE2",
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[EOSResult]:
    """Fit E(V) for every material, all scaled cells batched.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The materials (periodic in three directions; never modified).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name (``"lj"``, ``"sevennet-0"``), nvalchemi model or calculator.
    n_volumes : int
        Volumes per material (at least 5).
    strain : float
        Largest linear strain: lattice vectors are scaled by
        ``numpy.linspace(1 - strain, 1 + strain, n_volumes)`` (volumes by the
        cube), dimensionless, in (0, 0.5).
    relax : {None, "ions", "shape"}
        None: single points; ``"ions"``: positions relaxed at each fixed cell
        (one in-flight run over every cell of every material: a working
        batch that each cell leaves as it converges); ``"shape"``:
        cell shape and positions relaxed at each fixed volume
        (``FrechetCellFilter(constant_volume=True)`` with ``cell_optimizer``,
        one batched run).
    eos : str
        ASE's EOS form (:data:`ase.eos.eos_names`).
    fmax : float
        Force threshold of every relaxation, eV/Å.
    steps : int
        Step limit of each relaxation (each cell's own steps).
    optimizer : str
        Ion optimizer (``FIRE``, ``FIRE2``, ``LBFGS``, ``BFGS``).
    relax_first : bool
        Relax cell and ions of every material first (one batched run,
        ``FrechetCellFilter`` with ``cell_optimizer``) and scale the relaxed
        cells.
    cell_optimizer : str
        ``FIRE2`` (default), ``LBFGS``, or ``FIRE``/``BFGS`` (ASE's path on
        ASE's filter). nvalchemi 0.3's ``LBFGSVariableCell`` can take a first cell
        step large enough to collapse a small cell (a one-atom Cu cell with
        SevenNet-0 overflowed its neighbour list), which FIRE2 does not.
    device, dtype
        For a model given by name or object (see
        :func:`~nvalchemi_ase.properties._common.resolve_calculator`).
    memory_budget : float, optional
        Bytes a batch may be estimated to need (default: half of the memory
        free on the device).

    Returns
    -------
    list of EOSResult
        One per material, in input order; a failed material has ``error``
        set (and None numbers) while the others are computed.

    Raises
    ------
    ValueError
        For invalid arguments.
    """
    _check_arguments(n_volumes, strain, relax, eos, optimizer, cell_optimizer)
    calc, structures, ledger, references = prepared_materials(
        images,
        model,
        device=device,
        dtype=dtype,
        relax=relax_first,
        fmax=fmax,
        steps=steps,
        cell_optimizer=cell_optimizer,
        memory_budget=memory_budget,
    )
    factors = np.linspace(1.0 - strain, 1.0 + strain, n_volumes)
    derived = _scaled_cells(references, factors, ledger)
    if relax == "shape":
        relax_steps = relax_structures(
            calc,
            derived,
            ledger,
            fmax=fmax,
            steps=steps,
            optimizer=cell_optimizer,
            cell=True,
            constant_volume=True,
            memory_budget=memory_budget,
        )
        results = evaluate(
            calc, derived, ["energy"], ledger, memory_budget=memory_budget
        )
    else:
        results, relax_steps = evaluate_or_relax(
            calc,
            derived,
            ledger,
            ["energy"],
            relax=relax == "ions",
            fmax=fmax,
            steps=steps,
            optimizer=optimizer,
            memory_budget=memory_budget,
        )
    per_material: dict[int, list[int]] = {}
    for k, item in enumerate(derived):
        per_material.setdefault(item.material, []).append(k)
    out = []
    for index, atoms in enumerate(structures):
        result = EOSResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            eos=eos,
            relax=relax,
            relax_first=relax_first,
        )
        rows = per_material.get(index, [])
        if ledger.alive(index):
            volumes = np.array([derived[k].atoms.get_volume() for k in rows])
            energies = gather(results, rows, "energy")
            reference = references[index].cell.array.copy()
            ledger.guard(
                index,
                partial(_fit, result, volumes, energies, reference, eos),
                f"fitting the {eos} EOS",
            )
            result.relax_steps = relax_steps[rows]
            result.frames = _frames(derived, results, rows)
        result.error = ledger.errors.get(index)
        if result.error is not None:
            result.v0 = result.e0 = result.B = result.fit = None
        out.append(result)
    return out


def _frames(
    derived: Sequence[Derived], results: list[dict[str, Any] | None], rows: list[int]
) -> list[Atoms]:
    """Return the material's scaled cells, each with its own results attached."""
    frames = []
    for k in rows:
        atoms = derived[k].atoms.copy()
        values = results[k] or {}
        atoms.calc = SinglePointCalculator(
            atoms,
            **{key: values[key] for key in ("energy", "forces") if key in values},
        )
        frames.append(atoms)
    return frames


def _check_arguments(
    n_volumes: int,
    strain: float,
    relax: RelaxMode,
    eos: str,
    optimizer: str,
    cell_optimizer: str,
) -> None:
    if relax not in (None, "ions", "shape"):
        raise ValueError(f"relax must be None, 'ions' or 'shape', got {relax!r}")
    if int(n_volumes) != n_volumes or n_volumes < 5:
        raise ValueError(f"n_volumes must be an integer >= 5, got {n_volumes}")
    if not 0 < strain < 0.5:
        raise ValueError(f"strain must be in (0, 0.5) (linear, ±), got {strain}")
    if eos not in eos_names:
        raise ValueError(f"eos must be one of {', '.join(eos_names)}, got {eos!r}")
    if optimizer not in FIXED_CELL_OPTIMIZERS:
        raise ValueError(
            f"optimizer must be one of {', '.join(FIXED_CELL_OPTIMIZERS)}, "
            f"got {optimizer!r}"
        )
    if cell_optimizer not in VARIABLE_CELL_OPTIMIZERS:
        raise ValueError(
            f"cell_optimizer must be one of {', '.join(VARIABLE_CELL_OPTIMIZERS)}, "
            f"got {cell_optimizer!r}"
        )


def _scaled_cells(
    references: list[Atoms], factors: np.ndarray, ledger: Ledger
) -> list[Derived]:
    derived = []
    for index, reference in enumerate(references):
        if not ledger.alive(index):
            continue
        for k, factor in enumerate(factors):
            atoms = reference.copy()
            atoms.calc = None
            atoms.set_cell(reference.cell.array * factor, scale_atoms=True)
            label = f"volume {k + 1}/{len(factors)} (lattice x {factor:.4f})"
            derived.append(Derived(index, atoms, label))
    return derived


def _fit(
    result: EOSResult,
    volumes: np.ndarray,
    energies: np.ndarray,
    reference_cell: np.ndarray,
    eos: str,
) -> None:
    """Fit one material's E(V) with ASE and fill ``result`` in."""
    result.volumes, result.energies = volumes, energies
    result.reference_cell = reference_cell
    fit = EquationOfState(volumes, energies, eos=eos)
    v0, e0, bulk = fit.fit(warn=False)
    if not all(np.isfinite([v0, e0, bulk])) or bulk <= 0:
        raise ValueError(f"no minimum found (V0 = {v0}, B = {bulk} eV/Å³)")
    if not volumes.min() <= v0 <= volumes.max():
        raise ValueError(
            f"the fitted minimum V0 = {v0:.4g} Å³ lies outside the sampled volumes "
            f"{volumes.min():.4g}-{volumes.max():.4g} Å³; start closer to "
            "equilibrium (relax_first=True) or widen strain"
        )
    result.v0, result.e0, result.B = float(v0), float(e0), float(bulk / units.GPa)
    scale = (v0 / abs(np.linalg.det(reference_cell))) ** (1.0 / 3.0)
    result.cell0 = reference_cell * scale
    result.fit = fit
