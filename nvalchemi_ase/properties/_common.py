"""What every property workflow shares: materials, derived structures, batched runs.

A workflow turns each of M materials into derived structures (scaled, strained
or displaced copies), evaluates or relaxes *all* of them together, and folds
the numbers back into one result per material. This module holds the parts
that do not depend on the property:

* :func:`resolve_calculator`: a model name, nvalchemi model or
  ``NVAlchemiCalculator`` → one calculator;
* :func:`materials` and :func:`validate`: copies of the inputs, and the
  materials the model cannot run on (failed with the reason up front);
* :class:`Derived` and :class:`Ledger`: which material a derived structure
  belongs to, and which materials have failed (with the reason);
* :func:`evaluate`: single points of every derived structure in as few
  ``calculate_batch`` calls as the memory budget allows;
* :func:`relax_structures`: every derived structure relaxed, each converging
  on its own: ion relaxations through the in-flight runner
  (:func:`nvalchemi_ase.runners.relax`, a working batch within the memory
  budget, :func:`atom_budget`, that converged structures leave), cell
  relaxations in one batched optimizer run (a few, when the memory budget
  says so); :func:`relax_and_evaluate` leaves out those already converged
  and keeps the runner's results at the relaxed geometries, and
  :func:`relax_cells` relaxes cell and ions of the materials themselves.

Failures are isolated per material: an exception raised by a batched call is
retried material by material (from the structures as they were before the
call), so only the materials that fail on their own are reported (their first
reason is kept); non-finite results, failed or unconverged relaxations fail
their material only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from ase import Atoms

from nvalchemi_ase.calculator import NVAlchemiCalculator
from nvalchemi_ase.convert import StructureError, as_atoms_list, check_images
from nvalchemi_ase.dynamics.failures import StructureFailedWarning
from nvalchemi_ase.models.memory import (
    SAFETY_FRACTION,
    available_memory,
    count_edges,
    memory_estimate,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.devices import DtypeLike

__all__ = [
    "FIXED_CELL_OPTIMIZERS",
    "VARIABLE_CELL_OPTIMIZERS",
    "Derived",
    "Ledger",
    "MaterialResult",
    "atom_budget",
    "evaluate",
    "evaluate_or_relax",
    "gather",
    "materials",
    "plan_chunks",
    "relax_and_evaluate",
    "relax_cells",
    "relax_structures",
    "resolve_calculator",
    "validate",
]

#: Optimizers for fixed-cell (ion) relaxations, by ASE name.
FIXED_CELL_OPTIMIZERS = ("FIRE", "FIRE2", "LBFGS", "BFGS")
#: Optimizers that relax the cell under ``FrechetCellFilter`` (FIRE and BFGS
#: on ASE's filter coordinates, FIRE2 and LBFGS on nvalchemi's engines).
VARIABLE_CELL_OPTIMIZERS = ("FIRE2", "LBFGS", "FIRE", "BFGS")


#: The runner's refill threshold for the property workflows' small cells, in
#: whole-batch steps (:func:`nvalchemi_ase.runners.irelax`'s ``refill_steps``,
#: whose default is already 1 for autograd-force models such as SevenNet-0 and
#: 6 for direct-force ones such as LJ): measured on the section 9 sets, 1
#: evaluates 25 % fewer cells than 6 and is 1.4× faster on SevenNet-0, the same
#: on LJ.
REFILL_STEPS = 1.0


def resolve_calculator(
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
) -> NVAlchemiCalculator:
    """Return the calculator a workflow runs on.

    Parameters
    ----------
    model : str, BaseModelMixin or NVAlchemiCalculator
        A :func:`~nvalchemi_ase.models.load_model` name (``"lj"``,
        ``"sevennet-0"``), an nvalchemi model, or a calculator (used as is).
    device, dtype
        Where and in which precision to run a model given by name or object
        (see :class:`~nvalchemi_ase.calculator.NVAlchemiCalculator`); must be
        None with a calculator, which has its own.

    Returns
    -------
    NVAlchemiCalculator
        The calculator.

    Raises
    ------
    ValueError
        If ``device``/``dtype`` are given together with a calculator.
    """
    if isinstance(model, NVAlchemiCalculator):
        if device is not None or dtype is not None:
            raise ValueError(
                "device/dtype cannot be given with an NVAlchemiCalculator (it has "
                f"its own: {model.device}, {model.dtype}); pass the model instead"
            )
        return model
    return NVAlchemiCalculator(model, device=device, dtype=dtype)


def materials(images: Atoms | Sequence[Atoms]) -> list[Atoms]:
    """Copy the input materials, without calculators or results.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        One material or several.

    Returns
    -------
    list of ase.Atoms
        Copies (the caller's structures are never modified).

    Raises
    ------
    ValueError
        If there are no materials.
    """
    atoms_list = as_atoms_list(images)
    if not atoms_list:
        raise ValueError("no materials given")
    copies = []
    for atoms in atoms_list:
        copy = atoms.copy()
        copy.calc = None
        copies.append(copy)
    return copies


def validate(
    calc: NVAlchemiCalculator,
    structures: Sequence[Atoms],
    ledger: Ledger,
    *,
    periodic: bool = False,
) -> None:
    """Fail, with the reason, every material the model cannot be run on.

    Runs :func:`~nvalchemi_ase.convert.check_images` (finite positions and
    cell, elements the model knows, no overlapping atoms, ...) on each
    material, so that nothing downstream (phonopy and spglib crash on
    non-finite input) sees an invalid structure.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        Its model is checked against.
    structures : sequence of ase.Atoms
        The materials.
    ledger : Ledger
        Failures are recorded here.
    periodic : bool
        Also require a cell periodic in all three directions (bulk
        properties).
    """
    for index, atoms in enumerate(structures):
        try:
            check_images([atoms], model=calc.model)
        except StructureError as error:
            ledger.fail(index, f"invalid structure ({_describe(error)})")
            continue
        if periodic and (not atoms.pbc.all() or atoms.cell.rank < 3):
            ledger.fail(
                index,
                "this property needs a cell periodic in all three directions "
                f"(pbc = {atoms.pbc.tolist()})",
            )


@dataclass
class Derived:
    """One structure derived from a material (scaled, strained, displaced).

    Attributes
    ----------
    material : int
        Index of the material it belongs to.
    atoms : ase.Atoms
        The structure (owned by the workflow; relaxations move it).
    label : str
        What it is, for failure messages (e.g. ``"volume 3/7"``).
    """

    material: int
    atoms: Atoms
    label: str


class Ledger:
    """Which materials are still alive, and why the others failed.

    Parameters
    ----------
    count : int
        Number of materials.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.errors: dict[int, str] = {}

    def fail(self, material: int, reason: str) -> None:
        """Mark ``material`` failed (the first reason is kept)."""
        self.errors.setdefault(material, reason)

    def alive(self, material: int) -> bool:
        """Whether ``material`` has not failed."""
        return material not in self.errors

    def guard(self, material: int, action: Callable[[], Any], what: str) -> Any:
        """Run a per-material step; an exception fails the material instead.

        Parameters
        ----------
        material : int
            The material.
        action : callable
            The step (fitting, post-processing, ...).
        what : str
            What the step is, for the reason (e.g. ``"fitting the EOS"``).

        Returns
        -------
        Any
            The step's return value, or None if it raised.
        """
        if not self.alive(material):
            return None
        try:
            return action()
        except Exception as error:  # isolated per material
            self.fail(material, f"{what} failed ({_describe(error)})")
            return None


@dataclass
class MaterialResult:
    """What every per-material result has.

    Attributes
    ----------
    index : int
        Position of the material in the input list.
    formula : str
        Its chemical formula (``Atoms.get_chemical_formula()``).
    natoms : int
        Atoms in the input structure.
    error : str or None
        Why the material failed (None when it did not); every number of a
        failed material is None.
    """

    index: int
    formula: str
    natoms: int
    error: str | None = None

    #: Units of the fields, written into JSON next to the values.
    UNITS: ClassVar[dict[str, str]] = {}

    @property
    def ok(self) -> bool:
        """Whether the material was computed (no error)."""
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields: arrays as nested lists, non-finite numbers as None.

        Returns
        -------
        dict
            Every dataclass field except objects that do not serialise (such
            as the phonopy or ASE objects kept for further analysis), plus
            ``"units"``.
        """
        data: dict[str, Any] = {}
        for item in fields(self):
            if item.metadata.get("json") is False:
                continue
            data[item.name] = to_json(getattr(self, item.name))
        data["units"] = dict(self.UNITS)
        return data


def to_json(value: Any) -> Any:
    """``value`` with arrays as lists and NaN/inf as None (valid JSON)."""
    if isinstance(value, np.ndarray):
        return to_json(value.tolist())
    if isinstance(value, list | tuple):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {str(key): to_json(item) for key, item in value.items()}
    if isinstance(value, np.bool_ | bool):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    return value


# -- batches ------------------------------------------------------------------------


def plan_chunks(
    calc: NVAlchemiCalculator,
    structures: Sequence[Atoms],
    memory_budget: float | None = None,
) -> list[list[int]]:
    """Split structures into consecutive batches within a memory budget.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        Its model, dtype and device give the estimate
        (:func:`~nvalchemi_ase.models.memory.memory_estimate`).
    structures : sequence of ase.Atoms
        The structures, in order.
    memory_budget : float, optional
        Bytes a batch may be estimated to need; default
        :data:`~nvalchemi_ase.models.memory.SAFETY_FRACTION` of
        :func:`~nvalchemi_ase.models.memory.available_memory` on the device.

    Returns
    -------
    list of list of int
        Indices of each batch. A structure estimated above the budget on its
        own gets a batch of its own (it fails alone if it does not fit).
    """
    if not structures:
        return []
    estimate = memory_estimate(calc.model, calc.dtype, calc.device)
    budget = (
        SAFETY_FRACTION * available_memory(calc.device)
        if memory_budget is None
        else float(memory_budget)
    )
    groups: list[list[int]] = []
    current: list[int] = []
    spent = 0.0
    for index, atoms in enumerate(structures):
        cost = estimate.bytes_for(len(atoms), count_edges(atoms, estimate.cutoff))
        if current and spent + cost > budget:
            groups.append(current)
            current, spent = [], 0.0
        current.append(index)
        spent += cost
    groups.append(current)
    return groups


def _by_material(derived: Sequence[Derived], indices: Sequence[int]) -> list[list[int]]:
    """Group ``indices`` by the material their structures belong to."""
    groups: dict[int, list[int]] = {}
    for index in indices:
        groups.setdefault(derived[index].material, []).append(index)
    return list(groups.values())


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


def _isolated(
    derived: Sequence[Derived],
    indices: list[int],
    ledger: Ledger,
    action: Callable[[list[int]], None],
    what: str,
) -> None:
    """Run ``action`` on all ``indices``; if it raises, material by material."""
    try:
        action(indices)
        return
    except Exception as error:  # isolated per material
        groups = _by_material(derived, indices)
        if len(groups) == 1:
            material = derived[indices[0]].material
            ledger.fail(material, f"{what} failed ({_describe(error)})")
            return
    for group in groups:
        try:
            action(group)
        except Exception as error:  # isolated per material
            ledger.fail(
                derived[group[0]].material, f"{what} failed ({_describe(error)})"
            )


# -- single points ---------------------------------------------------------------------


def evaluate(
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    properties: Sequence[str],
    ledger: Ledger,
    *,
    memory_budget: float | None = None,
) -> list[dict[str, Any] | None]:
    """Single points of every derived structure of the living materials, batched.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        The calculator.
    derived : sequence of Derived
        The structures.
    properties : sequence of str
        ASE properties (``"energy"`` eV, ``"forces"`` eV/Å, ``"stress"``
        eV/Å³ Voigt, tensile positive).
    ledger : Ledger
        Materials that fail (exception, non-finite result) are marked here.
    memory_budget : float, optional
        Bytes per batch (see :func:`plan_chunks`).

    Returns
    -------
    list of dict or None
        One result dict per derived structure (as ``calculate_batch`` gives
        it); None for structures of failed materials.
    """
    results: list[dict[str, Any] | None] = [None] * len(derived)
    alive = [k for k, item in enumerate(derived) if ledger.alive(item.material)]
    atoms = [derived[k].atoms for k in alive]
    for chunk in plan_chunks(calc, atoms, memory_budget):
        indices = [alive[k] for k in chunk]

        def run(selected: list[int]) -> None:
            batch = calc.calculate_batch(
                [derived[k].atoms for k in selected], properties
            )
            for k, result in zip(selected, batch, strict=True):
                results[k] = result

        _isolated(derived, indices, ledger, run, "the batched evaluation")
    _check_finite(derived, results, ledger)
    return [
        result if ledger.alive(item.material) else None
        for item, result in zip(derived, results, strict=True)
    ]


def _check_finite(
    derived: Sequence[Derived],
    results: Sequence[dict[str, Any] | None],
    ledger: Ledger,
) -> None:
    """Fail the material of every result with a non-finite value."""
    for k, result in enumerate(results):
        if result is None:
            continue
        bad = [
            name
            for name in ("energy", "forces", "stress")
            if name in result and not np.isfinite(result[name]).all()
        ]
        if bad:
            ledger.fail(
                derived[k].material, f"{derived[k].label}: non-finite {', '.join(bad)}"
            )


def gather(
    results: Sequence[dict[str, Any] | None], indices: Sequence[int], name: str
) -> np.ndarray:
    """Stack property ``name`` of the results at ``indices`` (all must exist).

    Parameters
    ----------
    results : sequence of dict or None
        As :func:`evaluate` returns them.
    indices : sequence of int
        Which ones.
    name : str
        The property (``"energy"``, ``"forces"``, ``"stress"``).

    Returns
    -------
    numpy.ndarray
        Shape ``(len(indices), *shape of the property)``.

    Raises
    ------
    ValueError
        If one of them is missing (its material failed).
    """
    values = []
    for k in indices:
        result = results[k]
        if result is None or name not in result:
            raise ValueError(f"no {name} for derived structure {k}")
        values.append(result[name])
    return np.asarray(values)


# -- relaxations --------------------------------------------------------------------


def relax_structures(
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    ledger: Ledger,
    *,
    fmax: float,
    steps: int,
    optimizer: str,
    cell: bool = False,
    constant_volume: bool = False,
    memory_budget: float | None = None,
) -> np.ndarray:
    """Relax every derived structure of the living materials, batched.

    Each structure converges on its own (ASE's criterion: largest force below
    ``fmax``, cell forces included with ``cell=True``); the structures are
    moved in place. A structure that fails (non-finite or exploding, see
    :mod:`nvalchemi_ase.dynamics.failures`) or does not converge within
    ``steps`` fails its material.

    Ion relaxations (``cell=False``) go through the in-flight runner
    (:func:`nvalchemi_ase.runners.relax`): a working batch within the memory
    budget that converged structures leave (and queued ones enter), so a
    structure costs model evaluations for its own steps, not for the
    slowest one's. Cell relaxations are one batched optimizer run per memory
    chunk (the runner refills a variable-cell batch only once all of it has
    finished, so it would bring nothing there).

    Parameters
    ----------
    calc : NVAlchemiCalculator
        The calculator (attached to the structures for the run).
    derived : sequence of Derived
        The structures.
    ledger : Ledger
        Where failures are recorded.
    fmax : float
        Convergence threshold, eV/Å.
    steps : int
        Step limit of each structure (its own steps).
    optimizer : str
        ``nvalchemi_ase.optimize`` class name (:data:`FIXED_CELL_OPTIMIZERS`,
        or :data:`VARIABLE_CELL_OPTIMIZERS` with ``cell=True``).
    cell : bool
        Relax the cell too (ASE's ``FrechetCellFilter``).
    constant_volume : bool
        With ``cell``: keep each cell's volume (``constant_volume=True``; the
        shape relaxes).
    memory_budget : float, optional
        Bytes a batch may be estimated to need (see :func:`plan_chunks`;
        ion relaxations: see :func:`atom_budget`).

    Returns
    -------
    numpy.ndarray of int, shape (len(derived),)
        Step at which each structure converged (-1: not relaxed or failed).
    """
    if not cell:
        converged_at, _ = _relax_ions(
            calc,
            derived,
            ledger,
            fmax=fmax,
            steps=steps,
            optimizer=optimizer,
            properties=("energy", "forces"),
            memory_budget=memory_budget,
        )
        return converged_at
    optimizer_class = _optimizer_class(optimizer, cell)
    converged_at = np.full(len(derived), -1)
    alive = [k for k, item in enumerate(derived) if ledger.alive(item.material)]
    atoms = [derived[k].atoms for k in alive]
    for chunk in plan_chunks(calc, atoms, memory_budget):
        indices = [alive[k] for k in chunk]

        def run(selected: list[int]) -> None:
            saved = [_state(derived[k].atoms) for k in selected]
            try:
                steps_taken = _run_optimizer(
                    optimizer_class,
                    calc,
                    derived,
                    selected,
                    ledger,
                    fmax,
                    steps,
                    cell,
                    constant_volume=constant_volume,
                )
            except BaseException:
                # a run stopped by an exception may have written part of its
                # state back: retries start again from the structures as given
                for k, state in zip(selected, saved, strict=True):
                    _restore(derived[k].atoms, state)
                raise
            converged_at[selected] = steps_taken

        what = f"the batched {optimizer}{' cell' if cell else ''} relaxation"
        _isolated(derived, indices, ledger, run, what)
    for k, item in enumerate(derived):
        if not ledger.alive(item.material):
            converged_at[k] = -1
    return converged_at


def atom_budget(
    calc: NVAlchemiCalculator,
    structures: Sequence[Atoms],
    memory_budget: float | None = None,
) -> int:
    """Atoms a working batch of ``structures`` may hold within a memory budget.

    The runner's budget (``max_atoms``) for the in-flight ion relaxations:
    the model's memory estimate per atom of the costliest structure (edges
    included, :func:`~nvalchemi_ase.models.memory.memory_estimate`) into the
    budget, so any working batch of at most that many atoms is estimated
    within it (exactly so when the structures are alike, as a material's
    derived cells are). Never fewer than the largest structure's atoms: one
    estimated above the budget on its own is run alone, as
    :func:`plan_chunks` does (it fails alone if it does not fit).

    Parameters
    ----------
    calc : NVAlchemiCalculator
        Its model, dtype and device give the estimate.
    structures : sequence of ase.Atoms
        The structures.
    memory_budget : float, optional
        Bytes; default :data:`~nvalchemi_ase.models.memory.SAFETY_FRACTION`
        of :func:`~nvalchemi_ase.models.memory.available_memory` on the
        device (as :func:`plan_chunks`).

    Returns
    -------
    int
        The working batch's atom limit.
    """
    total = sum(len(atoms) for atoms in structures)
    largest = max((len(atoms) for atoms in structures), default=1)
    estimate = memory_estimate(calc.model, calc.dtype, calc.device)
    budget = (
        SAFETY_FRACTION * available_memory(calc.device)
        if memory_budget is None
        else float(memory_budget)
    )
    rate = max(
        (
            estimate.bytes_for(len(atoms), count_edges(atoms, estimate.cutoff))
            / len(atoms)
            for atoms in structures
            if len(atoms)
        ),
        default=0.0,
    )
    if rate <= 0 or budget >= rate * total:
        return max(total, 1)
    return max(largest, int(budget // rate))


def _relax_ions(
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    ledger: Ledger,
    *,
    fmax: float,
    steps: int,
    optimizer: str,
    properties: Sequence[str],
    memory_budget: float | None = None,
) -> tuple[np.ndarray, list[dict[str, Any] | None]]:
    """Fixed-cell relaxation of the living materials' structures, in flight.

    Returns the step at which each structure converged (-1: not relaxed or
    failed) and its results at the relaxed geometry (``properties`` among
    energy, forces, stress, as the runner returns them; None where not
    relaxed or failed). The structures are moved in place.
    """
    optimizer_class = _optimizer_class(optimizer, False)
    converged_at = np.full(len(derived), -1)
    results: list[dict[str, Any] | None] = [None] * len(derived)
    alive = [k for k, item in enumerate(derived) if ledger.alive(item.material)]
    if not alive:
        return converged_at, results
    max_atoms = atom_budget(calc, [derived[k].atoms for k in alive], memory_budget)

    def run(selected: list[int]) -> None:
        relaxed = _run_in_flight(
            optimizer_class,
            calc,
            derived,
            selected,
            fmax=fmax,
            steps=steps,
            max_atoms=max_atoms,
            properties=properties,
        )
        # nothing is written back before the whole run has returned: a retry
        # (material by material) starts from the structures as given
        for k, atoms in zip(selected, relaxed, strict=True):
            item = derived[k]
            info = atoms.info
            if info.get("failure") is not None:
                ledger.fail(
                    item.material,
                    f"{item.label}: relaxation failed at step {info['steps']} "
                    f"({info['failure']})",
                )
                continue
            forces = atoms.calc.results["forces"]
            if not info.get("converged"):
                largest = float(np.linalg.norm(forces, axis=1).max(initial=0.0))
                ledger.fail(
                    item.material,
                    f"{item.label}: relaxation did not converge to fmax {fmax} eV/Å "
                    f"in {steps} steps (largest force {largest:.3g} eV/Å); "
                    "raise steps or loosen fmax",
                )
                continue
            item.atoms.positions = atoms.positions
            item.atoms.calc = None
            converged_at[k] = int(info["steps"])
            results[k] = {
                name: atoms.calc.results[name]
                for name in properties
                if name in atoms.calc.results
            }

    _isolated(derived, alive, ledger, run, f"the batched {optimizer} relaxation")
    for k, item in enumerate(derived):
        if not ledger.alive(item.material):
            converged_at[k] = -1
            results[k] = None
    return converged_at, results


def _run_in_flight(
    optimizer_class: Any,
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    selected: list[int],
    *,
    fmax: float,
    steps: int,
    max_atoms: int,
    properties: Sequence[str],
) -> list[Atoms]:
    """One :func:`nvalchemi_ase.runners.relax` call over ``selected`` (new Atoms)."""
    from nvalchemi_ase.runners import relax

    return relax(
        [derived[k].atoms for k in selected],
        calc,
        optimizer=optimizer_class,
        fmax=fmax,
        steps=steps,
        max_atoms=max_atoms,
        refill_steps=REFILL_STEPS,
        properties=tuple(properties),
        progress=False,
        distributed=False,
    )


def relax_and_evaluate(
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    ledger: Ledger,
    properties: Sequence[str],
    *,
    fmax: float,
    steps: int,
    optimizer: str,
    memory_budget: float | None = None,
) -> tuple[list[dict[str, Any] | None], np.ndarray]:
    """Relax the ions of every derived structure that needs it; results at the end.

    One batched single point of every structure comes first; structures whose
    largest force is already below ``fmax`` (ASE's criterion, e.g. strained
    cells whose atoms sit on inversion centres) keep that result and stay out
    of the optimizer. The others are relaxed in flight
    (:func:`relax_structures`: each leaves the working batch as it converges)
    and keep the runner's energy and forces at their relaxed geometry (the
    optimizer's last evaluation there: the same model on the same positions
    as a fresh evaluation, equal to it to rounding); when ``properties``
    holds ``"stress"`` they are evaluated again, batched, so stresses are
    those of a fresh evaluation.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        The calculator.
    derived : sequence of Derived
        The structures (relaxed ones are moved in place).
    ledger : Ledger
        Where failures are recorded.
    properties : sequence of str
        What the workflow needs at the relaxed geometries (``"energy"`` eV,
        ``"stress"`` eV/Å³, ...).
    fmax : float
        Convergence threshold, eV/Å.
    steps : int
        Step limit of each structure.
    optimizer : str
        :data:`FIXED_CELL_OPTIMIZERS` name.
    memory_budget : float, optional
        Bytes per batch (see :func:`plan_chunks` and :func:`atom_budget`).

    Returns
    -------
    results : list of dict or None
        One result per derived structure at its relaxed geometry (None for
        failed materials).
    relax_steps : numpy.ndarray of int, shape (len(derived),)
        Steps each structure took (0: already converged; -1: failed).
    """
    wanted = sorted({*properties, "forces"})
    results = evaluate(calc, derived, wanted, ledger, memory_budget=memory_budget)
    relax_steps = np.full(len(derived), -1)
    moving = []
    for k, result in enumerate(results):
        if result is None:
            continue
        if np.linalg.norm(result["forces"], axis=1).max() < fmax:
            relax_steps[k] = 0
        else:
            moving.append(k)
    if moving:
        subset = [derived[k] for k in moving]
        steps_taken, relaxed = _relax_ions(
            calc,
            subset,
            ledger,
            fmax=fmax,
            steps=steps,
            optimizer=optimizer,
            properties=("energy", "forces"),
            memory_budget=memory_budget,
        )
        relax_steps[moving] = steps_taken
        if "stress" in wanted:
            # one batched evaluation (a few, by the memory budget), not the
            # runner's: it evaluates a stress the optimizer did not compute in
            # one small call per group of cells finishing together
            relaxed = evaluate(
                calc, subset, wanted, ledger, memory_budget=memory_budget
            )
        _check_finite(subset, relaxed, ledger)
        for k, result in zip(moving, relaxed, strict=True):
            results[k] = result
    final = [
        result if ledger.alive(item.material) else None
        for item, result in zip(derived, results, strict=True)
    ]
    relax_steps[[k for k, result in enumerate(final) if result is None]] = -1
    return final, relax_steps


def evaluate_or_relax(
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    ledger: Ledger,
    properties: Sequence[str],
    *,
    relax: bool,
    fmax: float,
    steps: int,
    optimizer: str,
    memory_budget: float | None = None,
) -> tuple[list[dict[str, Any] | None], np.ndarray]:
    """Results of every derived structure, its ions relaxed first or not.

    :func:`relax_and_evaluate` with ``relax``, else one batched
    :func:`evaluate` (the parameters and returns of :func:`relax_and_evaluate`;
    ``relax_steps`` is then -1 everywhere: not relaxed).
    """
    if relax:
        return relax_and_evaluate(
            calc,
            derived,
            ledger,
            properties,
            fmax=fmax,
            steps=steps,
            optimizer=optimizer,
            memory_budget=memory_budget,
        )
    results = evaluate(calc, derived, properties, ledger, memory_budget=memory_budget)
    return results, np.full(len(derived), -1)


def _state(atoms: Atoms) -> tuple[np.ndarray, np.ndarray]:
    """Copy what a relaxation changes: positions and cell."""
    return atoms.positions.copy(), atoms.cell.array.copy()


def _restore(atoms: Atoms, state: tuple[np.ndarray, np.ndarray]) -> None:
    positions, cell = state
    atoms.set_cell(cell, scale_atoms=False)
    atoms.positions = positions
    atoms.calc = None


def _optimizer_class(name: str, cell: bool) -> Any:
    from nvalchemi_ase import optimize

    allowed = VARIABLE_CELL_OPTIMIZERS if cell else FIXED_CELL_OPTIMIZERS
    if name not in allowed:
        kind = "cell" if cell else "fixed-cell"
        raise ValueError(
            f"optimizer {name!r} cannot run {kind} relaxations here; choose one of "
            f"{', '.join(allowed)}"
        )
    return getattr(optimize, name)


def _run_optimizer(
    optimizer_class: Any,
    calc: NVAlchemiCalculator,
    derived: Sequence[Derived],
    selected: list[int],
    ledger: Ledger,
    fmax: float,
    steps: int,
    cell: bool,
    *,
    constant_volume: bool = False,
) -> np.ndarray:
    """One batched optimizer run over ``selected``; failures go to the ledger."""
    from ase.filters import FrechetCellFilter

    atoms = [derived[k].atoms for k in selected]
    for item in atoms:
        item.calc = calc
    targets = (
        [FrechetCellFilter(item, constant_volume=constant_volume) for item in atoms]
        if cell
        else atoms
    )
    opt = optimizer_class(targets, logfile=None)
    try:
        with warnings.catch_warnings():
            # failures are reported per material below
            warnings.simplefilter("ignore", StructureFailedWarning)
            opt.run(fmax=fmax, steps=steps)
            failures = opt.failures
    finally:
        opt.close()
    for failure in failures:
        item = derived[selected[failure.index]]
        ledger.fail(
            item.material,
            f"{item.label}: relaxation failed at step {failure.step} "
            f"({failure.reason})",
        )
    converged = opt.converged_mask
    largest = opt.fmax_per_structure
    for position, k in enumerate(selected):
        if not converged[position] and ledger.alive(derived[k].material):
            ledger.fail(
                derived[k].material,
                f"{derived[k].label}: relaxation did not converge to fmax {fmax} eV/Å "
                f"in {steps} steps (largest force {largest[position]:.3g} eV/Å); "
                "raise steps or loosen fmax",
            )
    for item in atoms:
        item.calc = None
    return np.asarray(opt.converged_at_step)


def relax_cells(
    calc: NVAlchemiCalculator,
    structures: list[Atoms],
    ledger: Ledger,
    *,
    fmax: float,
    steps: int,
    optimizer: str,
    memory_budget: float | None = None,
    symprec: float | None = None,
) -> list[Atoms]:
    """Relax cell and ions of every living material in one batched run.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        The calculator.
    structures : list of ase.Atoms
        The materials (not modified).
    ledger : Ledger
        Failures are recorded here.
    fmax : float
        Threshold on atomic and cell forces (ASE's ``FrechetCellFilter``), eV/Å.
    steps : int
        Step limit.
    optimizer : str
        ``FIRE2`` or ``LBFGS``.
    memory_budget : float, optional
        Bytes per batch.
    symprec : float, optional
        Keep each material's space group (found with this tolerance, Å)
        exactly: ``ase.constraints.FixSymmetry`` on the copies while they
        relax (the relaxed copies carry no constraint). Force constants
        need it: a cell relaxed to a finite ``fmax`` without it keeps a
        strain of order the stress tolerance, which lowers the symmetry.

    Returns
    -------
    list of ase.Atoms
        Relaxed copies (the input structure for a failed material).
    """
    derived = [
        Derived(index, atoms.copy(), "cell relaxation")
        for index, atoms in enumerate(structures)
        if ledger.alive(index)
    ]
    if symprec is not None:
        from ase.constraints import FixSymmetry

        for item in derived:
            item.atoms.set_constraint(FixSymmetry(item.atoms, symprec=symprec))
    relax_structures(
        calc,
        derived,
        ledger,
        fmax=fmax,
        steps=steps,
        optimizer=optimizer,
        cell=True,
        memory_budget=memory_budget,
    )
    relaxed = list(structures)
    for item in derived:
        if symprec is not None:
            item.atoms.set_constraint()
        relaxed[item.material] = item.atoms
    return relaxed


def prepared_materials(
    images: Atoms | Sequence[Atoms],
    model: Any,
    *,
    device: Any,
    dtype: Any,
    relax: bool,
    fmax: float,
    steps: int,
    cell_optimizer: str,
    memory_budget: float | None,
    symprec: float | None = None,
) -> tuple[NVAlchemiCalculator, list[Atoms], Ledger, list[Atoms]]:
    """Every bulk workflow's start: calculator, checked materials, references.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The materials (never modified), periodic in three directions.
    model : str, BaseModelMixin or NVAlchemiCalculator
        See :func:`resolve_calculator` (with ``device`` and ``dtype``).
    device, dtype
        For a model given by name or object.
    relax : bool
        Relax cell and ions of every material first (:func:`relax_cells`
        with ``fmax`` eV/Å, ``steps``, ``cell_optimizer``, ``memory_budget``
        bytes and ``symprec``).

    Returns
    -------
    tuple
        The calculator, the materials (copies), the failure ledger (materials
        refused by the checks already recorded) and the reference cells the
        workflow derives its structures from (the relaxed copies, or the
        materials themselves).
    """
    calc = resolve_calculator(model, device=device, dtype=dtype)
    structures = materials(images)
    ledger = Ledger(len(structures))
    validate(calc, structures, ledger, periodic=True)
    if not relax:
        return calc, structures, ledger, structures
    references = relax_cells(
        calc,
        structures,
        ledger,
        fmax=fmax,
        steps=steps,
        optimizer=cell_optimizer,
        memory_budget=memory_budget,
        symprec=symprec,
    )
    return calc, structures, ledger, references
