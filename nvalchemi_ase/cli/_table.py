"""Plain-text tables for command output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["RESULT_HEADER", "format_table", "result_row"]

#: Columns of :func:`result_row`.
RESULT_HEADER = (
    "structure",
    "formula",
    "atoms",
    "energy/eV",
    "eV/atom",
    "max|F|/(eV/Å)",
    "P/GPa",
)


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Format rows as a Markdown-style table with right-aligned columns.

    Parameters
    ----------
    header : sequence of str
        Column titles.
    rows : sequence of sequences
        Cell values, converted with ``str``.

    Returns
    -------
    str
        The table, one line per row, no trailing newline.
    """
    cells = [list(map(str, header)), *[list(map(str, row)) for row in rows]]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]

    def line(row: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def result_row(label: str, atoms: Any, result: dict[str, Any]) -> tuple[str, ...]:
    """One table row: label, formula, atoms, energy, energy/atom, max |F|, pressure.

    Parameters
    ----------
    label : str
        Where the structure came from.
    atoms : ase.Atoms
        The structure.
    result : dict
        ASE results (``energy`` eV, ``forces`` eV/Å, optional ``stress`` eV/Å³).

    Returns
    -------
    tuple of str
        Cells for :data:`RESULT_HEADER` (pressure "-" when there is no stress).
    """
    import numpy as np
    from ase import units

    from nvalchemi_ase.units import pressure_from_stress

    pressure = (
        f"{float(pressure_from_stress(result['stress'])) / units.GPa:.4f}"
        if "stress" in result
        else "-"
    )
    fmax = (
        np.linalg.norm(result["forces"], axis=1).max() if "forces" in result else np.nan
    )
    return (
        label,
        atoms.get_chemical_formula(),
        str(len(atoms)),
        f"{result['energy']:.6f}",
        f"{result['energy'] / len(atoms):.6f}",
        f"{fmax:.6f}",
        pressure,
    )
