"""Elastic constants of many materials at once, clamped or relaxed ions.

Each material's cell is strained along each of the six Voigt components
(``n_strains`` values in ``[-strain, strain]``); every strained cell of every
material is evaluated in one batched call, or — with ``relax_ions=True`` — its
ions are first relaxed at fixed cell in one in-flight run
(:func:`nvalchemi_ase.runners.relax`), each cell leaving the working batch
as it converges. ``C_ij`` is the least-squares slope of stress component
``i`` against strain component ``j``, as in
:func:`matscipy.elasticity.fit_elastic_constants` (triclinic patterns).

Sign: ASE's stress is tensile positive, ``σ = (1/V) ∂E/∂ε``, so stretching a
stable crystal gives a positive stress and ``C = +∂σ/∂ε`` (the stiffness is
positive); the pressure is ``-tr(σ)/3``. Strains are Voigt (engineering)
strains, ``e = (ε_xx, ε_yy, ε_zz, 2ε_yz, 2ε_xz, 2ε_xy)``, the deformation
gradient is ``F = 1 + ε`` (symmetric) and the strained cell is
``cell @ F.T`` with fractional coordinates kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from ase import Atoms, units

from nvalchemi_ase.properties._common import (
    FIXED_CELL_OPTIMIZERS,
    VARIABLE_CELL_OPTIMIZERS,
    Derived,
    Ledger,
    MaterialResult,
    evaluate_or_relax,
    gather,
    prepared_materials,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["ElasticResult", "elastic_constants", "moduli", "voigt_strain_matrix"]

#: Voigt index -> (row, column) of the 3x3 tensor (ASE's order).
VOIGT_PAIRS = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))


@dataclass
class ElasticResult(MaterialResult):
    """Elastic constants of one material.

    Attributes
    ----------
    C : numpy.ndarray, shape (6, 6)
        Elastic constants in Voigt notation (ASE's order xx yy zz yz xz xy),
        symmetrised ``(C + C.T) / 2``, GPa.
    C_raw : numpy.ndarray, shape (6, 6)
        The fitted slopes before symmetrisation, GPa (``C_raw[i, j]``: stress
        ``i`` against strain ``j``).
    compliance : numpy.ndarray, shape (6, 6)
        ``inv(C)``, 1/GPa (NaN if C is singular).
    bulk_voigt, bulk_reuss, bulk_hill : float
        Bulk modulus, Voigt (uniform strain), Reuss (uniform stress) and
        Hill (their mean) averages, GPa.
    shear_voigt, shear_reuss, shear_hill : float
        Shear modulus, same averages, GPa.
    youngs_hill : float
        Young's modulus from the Hill averages, ``9KG / (3K + G)``, GPa.
    poisson_hill : float
        Poisson's ratio from the Hill averages, dimensionless.
    strains : numpy.ndarray, shape (n_strains,)
        Voigt strain values applied to each component, dimensionless.
    stresses : numpy.ndarray, shape (6, n_strains, 6)
        ``stresses[j, k, i]``: stress component ``i`` with strain ``strains[k]``
        on component ``j``, GPa (ASE's sign, tensile positive).
    stress0 : numpy.ndarray, shape (6,)
        Stress of the unstrained cell (ions relaxed with ``relax_ions``), GPa;
        nonzero when the input cell is not at equilibrium.
    relax_ions : bool
        Whether ions were relaxed in every strained cell.
    relax_first : bool
        Whether cell and ions were relaxed before straining.
    reference_cell : numpy.ndarray, shape (3, 3)
        The cell that was strained, Å.
    relax_steps : numpy.ndarray of int, shape (6, n_strains)
        Steps each strained cell took to converge (0: its forces were already
        below ``fmax``; -1: not relaxed; the zero-strain entries repeat the
        reference's).
    """

    UNITS: ClassVar[dict[str, str]] = {
        "C": "GPa",
        "C_raw": "GPa",
        "compliance": "1/GPa",
        "bulk_voigt": "GPa",
        "bulk_reuss": "GPa",
        "bulk_hill": "GPa",
        "shear_voigt": "GPa",
        "shear_reuss": "GPa",
        "shear_hill": "GPa",
        "youngs_hill": "GPa",
        "poisson_hill": "1",
        "strains": "1 (Voigt strain)",
        "stresses": "GPa",
        "stress0": "GPa",
        "reference_cell": "Å",
    }

    C: np.ndarray | None = None
    C_raw: np.ndarray | None = None
    compliance: np.ndarray | None = None
    bulk_voigt: float | None = None
    bulk_reuss: float | None = None
    bulk_hill: float | None = None
    shear_voigt: float | None = None
    shear_reuss: float | None = None
    shear_hill: float | None = None
    youngs_hill: float | None = None
    poisson_hill: float | None = None
    strains: np.ndarray | None = None
    stresses: np.ndarray | None = None
    stress0: np.ndarray | None = None
    relax_ions: bool = True
    relax_first: bool = False
    reference_cell: np.ndarray | None = None
    relax_steps: np.ndarray | None = None


def elastic_constants(
    images: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    strain: float = 0.01,
    n_strains: int = 5,
    relax_ions: bool = True,
    fmax: float = 1e-3,
    steps: int = 1000,
    optimizer: str = "FIRE",
    relax_first: bool = False,
    cell_optimizer: str = "FIRE2",
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[ElasticResult]:
    """Compute the 6x6 elastic constants of every material, strained cells batched.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The materials (periodic in three directions; never modified), ideally
        at zero stress (see ``relax_first``).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name, nvalchemi model or calculator.
    strain : float
        Largest Voigt strain applied to each component, dimensionless, in
        (0, 0.1].
    n_strains : int
        Strain values per component, ``numpy.linspace(-strain, strain,
        n_strains)`` (at least 2; the zero strain, when odd, is the reference).
    relax_ions : bool
        Relax the ions of every strained cell at fixed cell (one in-flight
        run over all strained cells of all materials, each leaving the
        working batch as it converges); False: clamped ions.
    fmax : float
        Force threshold of every relaxation, eV/Å.
    steps : int
        Step limit of each relaxation (each cell's own steps).
    optimizer : str
        Ion optimizer (``FIRE``, ``FIRE2``, ``LBFGS``, ``BFGS``).
    relax_first : bool
        Relax cell and ions of every material first (one batched
        ``FrechetCellFilter`` run with ``cell_optimizer``).
    cell_optimizer : str
        ``FIRE2`` (default), ``LBFGS``, or ``FIRE``/``BFGS`` (ASE's path on
        ASE's filter). nvalchemi 0.3's ``LBFGSVariableCell``
        can take a first cell step large enough to collapse a small cell (a
        one-atom Cu cell with SevenNet-0 overflowed its neighbour list), which
        FIRE2 does not.
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need (default: half of the memory
        free on the device).

    Returns
    -------
    list of ElasticResult
        One per material, in input order; a failed material has ``error``
        set while the others are computed.

    Raises
    ------
    ValueError
        For invalid arguments.
    """
    _check_arguments(strain, n_strains, optimizer, cell_optimizer)
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
    values = np.linspace(-strain, strain, n_strains)
    derived, slots = _strained_cells(references, values, ledger)
    results, relax_steps = evaluate_or_relax(
        calc,
        derived,
        ledger,
        ["stress"],
        relax=relax_ions,
        fmax=fmax,
        steps=steps,
        optimizer=optimizer,
        memory_budget=memory_budget,
    )
    out = []
    for index, atoms in enumerate(structures):
        result = ElasticResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            relax_ions=relax_ions,
            relax_first=relax_first,
        )
        if ledger.alive(index):
            zero, table = slots[index]
            stresses = np.array([gather(results, row, "stress") for row in table])
            stress0 = gather(results, [zero], "stress")[0]
            steps_taken = np.array([[relax_steps[k] for k in row] for row in table])
            reference_cell = references[index].cell.array.copy()
            ledger.guard(
                index,
                partial(
                    _fill,
                    result,
                    values,
                    stresses,
                    stress0,
                    steps_taken,
                    reference_cell,
                ),
                "fitting the elastic constants",
            )
        result.error = ledger.errors.get(index)
        out.append(result)
    return out


def _check_arguments(
    strain: float, n_strains: int, optimizer: str, cell_optimizer: str
) -> None:
    if not 0 < strain <= 0.1:
        raise ValueError(f"strain must be in (0, 0.1] (Voigt strain), got {strain}")
    if int(n_strains) != n_strains or n_strains < 2:
        raise ValueError(f"n_strains must be an integer >= 2, got {n_strains}")
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


def voigt_strain_matrix(component: int, value: float) -> np.ndarray:
    """Symmetric strain tensor of one Voigt (engineering) strain component.

    Parameters
    ----------
    component : int
        Voigt index 0-5 (xx yy zz yz xz xy).
    value : float
        Voigt strain, dimensionless (shear components are ``2 ε_ij``).

    Returns
    -------
    numpy.ndarray, shape (3, 3)
        ``ε``, with ``ε_ij = ε_ji = value / 2`` for a shear component.
    """
    row, column = VOIGT_PAIRS[component]
    tensor = np.zeros((3, 3))
    if row == column:
        tensor[row, row] = value
    else:
        tensor[row, column] = tensor[column, row] = value / 2.0
    return tensor


def _strained_cells(
    references: list[Atoms], values: np.ndarray, ledger: Ledger
) -> tuple[list[Derived], dict[int, tuple[int, list[list[int]]]]]:
    """Every strained cell; per material its reference's index and a table.

    The table (6, n_strains) holds the index of each strained cell; the zero
    strain (odd ``n_strains``) points to the material's unstrained reference,
    which is evaluated once and always (it gives ``stress0``).
    """
    derived: list[Derived] = []
    slots: dict[int, tuple[int, list[list[int]]]] = {}
    for index, reference in enumerate(references):
        if not ledger.alive(index):
            continue
        base = reference.copy()
        base.calc = None
        derived.append(Derived(index, base, "unstrained cell"))
        zero = len(derived) - 1
        table = []
        for component in range(6):
            row = []
            for value in values:
                if value == 0.0:
                    row.append(zero)
                    continue
                deformation = np.eye(3) + voigt_strain_matrix(component, value)
                atoms = base.copy()
                atoms.set_cell(base.cell.array @ deformation.T, scale_atoms=True)
                label = f"strained cell (e{component + 1} = {value:+.4g})"
                derived.append(Derived(index, atoms, label))
                row.append(len(derived) - 1)
            table.append(row)
        slots[index] = (zero, table)
    return derived, slots


def _fill(
    result: ElasticResult,
    values: np.ndarray,
    stresses: np.ndarray,
    stress0: np.ndarray,
    relax_steps: np.ndarray,
    reference_cell: np.ndarray,
) -> None:
    """Fit C from the stresses (eV/Å³, (6, n, 6); (6,)) and fill ``result`` in."""
    gpa = stresses / units.GPa
    raw = np.empty((6, 6))
    for j in range(6):
        slopes = np.polyfit(values, gpa[j], 1)[0]  # one slope per stress component
        raw[:, j] = slopes
    stiffness = 0.5 * (raw + raw.T)
    if not np.isfinite(stiffness).all():
        raise ValueError("non-finite elastic constants")
    result.C, result.C_raw = stiffness, raw
    result.strains, result.stresses = values, gpa
    result.stress0 = stress0 / units.GPa
    result.reference_cell = reference_cell
    result.relax_steps = relax_steps
    figures = moduli(stiffness)
    result.compliance = figures.pop("compliance")
    for name, value in figures.items():
        setattr(result, name, value)


def moduli(C: np.ndarray) -> dict[str, Any]:  # noqa: N803 - the usual symbol
    """Voigt, Reuss and Hill bulk and shear moduli of a 6x6 stiffness matrix.

    Parameters
    ----------
    C : numpy.ndarray, shape (6, 6)
        Elastic constants, Voigt notation, any unit (GPa here).

    Returns
    -------
    dict
        ``bulk_voigt``, ``bulk_reuss``, ``bulk_hill``, ``shear_voigt``,
        ``shear_reuss``, ``shear_hill``, ``youngs_hill`` (unit of ``C``),
        ``poisson_hill`` (dimensionless) and ``compliance`` (6, 6) (inverse
        unit; NaN when ``C`` is singular, and then the Reuss and Hill values
        are NaN).
    """
    normal = C[0, 0] + C[1, 1] + C[2, 2]
    off = C[0, 1] + C[1, 2] + C[0, 2]
    shear = C[3, 3] + C[4, 4] + C[5, 5]
    bulk_voigt = (normal + 2.0 * off) / 9.0
    shear_voigt = (normal - off + 3.0 * shear) / 15.0
    try:
        compliance = np.linalg.inv(C)
    except np.linalg.LinAlgError:
        compliance = np.full((6, 6), np.nan)
    s_normal = compliance[0, 0] + compliance[1, 1] + compliance[2, 2]
    s_off = compliance[0, 1] + compliance[1, 2] + compliance[0, 2]
    s_shear = compliance[3, 3] + compliance[4, 4] + compliance[5, 5]
    with np.errstate(divide="ignore", invalid="ignore"):
        bulk_reuss = 1.0 / (s_normal + 2.0 * s_off)
        shear_reuss = 15.0 / (4.0 * s_normal - 4.0 * s_off + 3.0 * s_shear)
        bulk_hill = 0.5 * (bulk_voigt + bulk_reuss)
        shear_hill = 0.5 * (shear_voigt + shear_reuss)
        youngs = 9.0 * bulk_hill * shear_hill / (3.0 * bulk_hill + shear_hill)
        poisson = (3.0 * bulk_hill - 2.0 * shear_hill) / (
            2.0 * (3.0 * bulk_hill + shear_hill)
        )
    return {
        "bulk_voigt": float(bulk_voigt),
        "bulk_reuss": float(bulk_reuss),
        "bulk_hill": float(bulk_hill),
        "shear_voigt": float(shear_voigt),
        "shear_reuss": float(shear_reuss),
        "shear_hill": float(shear_hill),
        "youngs_hill": float(youngs),
        "poisson_hill": float(poisson),
        "compliance": compliance,
    }
