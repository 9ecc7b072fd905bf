"""Energies of many derived structures, relaxed in one stream or evaluated once.

What the surface, adsorption and defect workflows share: every structure of
every material (slabs, supercells with defects, clean references, molecules)
goes through one :func:`~nvalchemi_ase.properties._common.relax_and_evaluate`
call (ions relaxed at fixed cell through the in-flight runner,
:func:`nvalchemi_ase.runners.relax`; structures without forces above
``fmax`` stay out of it) or one batched
:func:`~nvalchemi_ase.properties._common.evaluate`, and comes back with its
energy attached for writing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator

from nvalchemi_ase.properties._common import (
    FIXED_CELL_OPTIMIZERS,
    Derived,
    Ledger,
    evaluate_or_relax,
)

if TYPE_CHECKING:
    from nvalchemi_ase.calculator import NVAlchemiCalculator

__all__ = ["check_relaxation", "energies", "with_energy"]


def check_relaxation(fmax: float, steps: int, optimizer: str) -> None:
    """Raise ``ValueError`` for relaxation settings that cannot run.

    Parameters
    ----------
    fmax : float
        Force threshold, eV/Å (positive).
    steps : int
        Step limit (positive integer).
    optimizer : str
        One of :data:`~nvalchemi_ase.properties._common.FIXED_CELL_OPTIMIZERS`.
    """
    if not fmax > 0 or not np.isfinite(fmax):
        raise ValueError(f"fmax must be positive and finite (eV/Å), got {fmax}")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    if optimizer not in FIXED_CELL_OPTIMIZERS:
        raise ValueError(
            f"optimizer must be one of {', '.join(FIXED_CELL_OPTIMIZERS)}, "
            f"got {optimizer!r}"
        )


def energies(
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    ledger: Ledger,
    *,
    relax: bool,
    fmax: float,
    steps: int,
    optimizer: str,
    memory_budget: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Energy of every derived structure, after one in-flight relaxation or not.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        The calculator.
    derived : sequence of Derived
        Every structure of every material (moved in place when relaxed).
    ledger : Ledger
        Failures (exceptions, non-finite results, unconverged relaxations)
        fail the structure's material here.
    relax : bool
        Relax the ions at fixed cell (one stream over all structures) or take
        single points (batched calls).
    fmax : float
        Force threshold of the relaxations, eV/Å.
    steps : int
        Step limit of each structure's relaxation.
    optimizer : str
        Ion optimizer (:data:`FIXED_CELL_OPTIMIZERS`).
    memory_budget : float, optional
        Bytes a batch may be estimated to need.

    Returns
    -------
    energies : numpy.ndarray, shape (len(derived),)
        Energies, eV (NaN for structures of failed materials).
    relax_steps : numpy.ndarray of int, shape (len(derived),)
        Optimizer steps each structure took (0: already below ``fmax``; -1:
        not relaxed or failed).
    """
    results, relax_steps = evaluate_or_relax(
        calc,
        derived,
        ledger,
        ["energy"],
        relax=relax,
        fmax=fmax,
        steps=steps,
        optimizer=optimizer,
        memory_budget=memory_budget,
    )
    values = np.array(
        [np.nan if result is None else float(result["energy"]) for result in results]
    )
    return values, relax_steps


def with_energy(atoms: Atoms, energy: float, **info: object) -> Atoms:
    """Copy ``atoms`` with ``energy`` (eV) attached for ASE's writers.

    Parameters
    ----------
    atoms : ase.Atoms
        The structure.
    energy : float
        Its energy, eV (a ``SinglePointCalculator`` result).
    **info
        Entries added to ``atoms.info`` (written by extxyz).

    Returns
    -------
    ase.Atoms
        The copy.
    """
    copy = atoms.copy()
    copy.info.update(info)
    copy.calc = SinglePointCalculator(copy, energy=float(energy))
    return copy
