"""Per-structure results as a table: ``to_dataframe(opt)`` in a notebook.

One row per structure, whatever produced it: a batched optimizer or MD object
(``nvalchemi_ase.optimize``, ``nvalchemi_ase.md``), the structures a runner
returned (``runners.relax``, ``runners.single_points``: their ``info`` carries
``index``, ``converged``, ``steps``, ``failure``), or any list of ``Atoms``
with results (after ``calc.calculate_batch``, or read from an extxyz file).
Nothing is evaluated: the table reads what is already there (a structure
without stored results has NaN energy).

Columns and units (``DataFrame.attrs["units"]`` repeats them): ``formula``,
``natoms``; ``energy`` eV; ``fmax`` eV/Å; ``volume`` Å³ (periodic cells);
optimizers add ``converged`` and ``converged_at_step`` (-1: not converged);
MD adds ``ekin`` eV and ``temperature`` K; dynamics add ``failed``,
``failed_at_step`` and ``failure`` (the reason, or None). ``pandas`` is
needed (``pip install "nvalchemi-ase[notebook]"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas
    from ase import Atoms

__all__ = ["UNITS", "to_dataframe"]

#: Units of the numeric columns.
UNITS = {
    "natoms": "",
    "energy": "eV",
    "fmax": "eV/Å",
    "volume": "Å^3",
    "ekin": "eV",
    "temperature": "K",
    "converged_at_step": "step",
    "failed_at_step": "step",
    "steps": "step",
}

#: ``info`` keys a runner's result structures carry, copied into the table.
_INFO_KEYS = ("index", "converged", "steps", "failure", "material")


def to_dataframe(source: Any) -> pandas.DataFrame:
    """One row per structure of a batched run, a runner's results, or a list of Atoms.

    Parameters
    ----------
    source : dynamics object, ase.Atoms or iterable of ase.Atoms
        A batched optimizer or MD object of this package (its current state:
        energies as of its last step), or structures with stored results.

    Returns
    -------
    pandas.DataFrame
        Indexed by structure (0 … B-1); the columns of this module's
        docstring; ``attrs["units"]`` maps column names to units.

    Raises
    ------
    ImportError
        Without ``pandas`` (the extra to install is named).
    TypeError
        For anything else.
    """
    try:
        import pandas
    except ImportError as error:
        raise ImportError(
            'to_dataframe needs pandas: pip install "nvalchemi-ase[notebook]"'
        ) from error
    if hasattr(source, "images") and hasattr(source, "failures"):
        columns = _dynamics_columns(source)
    else:
        columns = _atoms_columns(_as_atoms_list(source))
    frame = pandas.DataFrame(columns)
    frame.index.name = "structure"
    frame.attrs["units"] = {key: UNITS[key] for key in frame.columns if key in UNITS}
    return frame


def _as_atoms_list(source: Any) -> list[Atoms]:
    from ase import Atoms

    if isinstance(source, Atoms):
        return [source]
    if isinstance(source, Iterable) and not isinstance(source, str | bytes):
        images = list(source)
        if all(isinstance(atoms, Atoms) for atoms in images):
            return images
    raise TypeError(
        "to_dataframe takes a dynamics object of nvalchemi_ase, an Atoms or a "
        f"list of Atoms, got {type(source).__name__}"
    )


def _atoms_columns(images: list[Atoms]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {
        "formula": [atoms.get_chemical_formula() for atoms in images],
        "natoms": [len(atoms) for atoms in images],
        "energy": [_stored(atoms, "energy") for atoms in images],
        "fmax": [_fmax(_stored(atoms, "forces")) for atoms in images],
        "volume": [
            atoms.get_volume() if atoms.pbc.all() else np.nan for atoms in images
        ],
    }
    for key in _INFO_KEYS:
        if any(key in atoms.info for atoms in images):
            columns[key] = [atoms.info.get(key) for atoms in images]
    return columns


def _stored(atoms: Atoms, name: str) -> Any:
    """Return a result the structure already holds (never evaluated anew), or None."""
    results = getattr(atoms.calc, "results", None) or {}
    value = results.get(name)
    if value is None and name == "energy":
        return np.nan
    return value


def _fmax(forces: Any) -> float:
    if forces is None or len(forces) == 0:
        return float("nan")
    return float(np.linalg.norm(np.asarray(forces), axis=1).max())


def _dynamics_columns(dyn: Any) -> dict[str, list[Any]]:
    images = dyn.images
    count = len(images)
    columns: dict[str, list[Any]] = {
        "formula": [atoms.get_chemical_formula() for atoms in images],
        "natoms": [len(atoms) for atoms in images],
    }
    if hasattr(dyn, "energy_per_structure"):  # optimizers
        columns["energy"] = list(dyn.energy_per_structure)
        columns["fmax"] = list(dyn.fmax_per_structure)
        columns["converged"] = list(dyn.converged_mask)
        columns["converged_at_step"] = list(dyn.converged_at_step)
    else:  # MD
        thermo = dyn.per_structure_thermo()
        columns["energy"] = list(thermo["epot"])
        columns["ekin"] = list(thermo["ekin"])
        columns["temperature"] = list(thermo["temperature"])
    columns["volume"] = [
        atoms.get_volume() if atoms.pbc.all() else np.nan for atoms in images
    ]
    failed_at = np.full(count, -1)
    reasons: list[str | None] = [None] * count
    for failure in dyn.failures:
        failed_at[failure.index] = failure.step
        reasons[failure.index] = failure.reason
    columns["failed"] = list(failed_at >= 0)
    columns["failed_at_step"] = list(failed_at)
    columns["failure"] = reasons
    return columns
