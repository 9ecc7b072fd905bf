"""Quasi-harmonic thermodynamics of many materials at once (phonopy).

Each material (relaxed first, its space group kept) is scaled to
``n_volumes`` cells, as :func:`~nvalchemi_ase.properties.equation_of_state`
does; the ions are relaxed at each fixed cell (one in-flight run over every
cell of every material); phonopy (extra ``nvalchemi-ase[properties]``)
builds the displaced supercells of every volume, and the forces on all of
them, of all volumes and materials, come from batched ``calculate_batch``
calls in one stream. phonopy's :func:`phonopy.run_qha` fits F(V; T) =
E(V) + F_phonon(V; T) at each temperature and gives V(T), the thermal
expansion, B(T), the Gibbs energy and C_P.

phonopy normalises everything to its primitive cell; the results here are
per **input cell** (energies, volumes, entropies and heat capacities times
``n_primitive_cells``), so ``volumes`` and ``volume_temperature`` compare
with the input cell's volume and an EOS of the same cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from ase import Atoms, units

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
)
from nvalchemi_ase.properties.eos import _scaled_cells
from nvalchemi_ase.properties.phonons import (
    _displaced,
    _mesh,
    _supercell_matrix,
    _to_ase,
    require_phonopy,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = ["QHA_EOS", "QHAResult", "qha"]

#: phonopy's equations of state for the F(V) fits.
QHA_EOS = ("vinet", "birch_murnaghan", "murnaghan")

#: Default temperatures, K (the last one is consumed by phonopy's finite
#: differences).
DEFAULT_TEMPERATURES = tuple(float(t) for t in range(0, 1010, 10))

#: Default most negative frequency allowed on the mesh at any volume, THz.
IMAGINARY_TOLERANCE = 0.05


@dataclass
class QHAResult(MaterialResult):
    """Quasi-harmonic thermodynamics of one material, per input cell.

    Attributes
    ----------
    volumes : numpy.ndarray, shape (n_volumes,)
        Volumes of the scaled cells, Å³.
    energies : numpy.ndarray, shape (n_volumes,)
        Static-lattice energies at those volumes (ions relaxed with
        ``relax="ions"``), eV.
    relax_steps : numpy.ndarray of int, shape (n_volumes,)
        Ion-relaxation steps per volume (0: already converged; -1: none).
    n_displacements : numpy.ndarray of int, shape (n_volumes,)
        Displaced supercells per volume.
    min_frequencies : numpy.ndarray, shape (n_volumes,)
        Lowest frequency on the mesh at each volume, THz (imaginary
        negative).
    n_primitive_cells : int
        Primitive cells in the input cell (phonopy's per-primitive-cell
        numbers are multiplied by it).
    temperatures : numpy.ndarray, shape (N,)
        Temperatures of the results, K (the input temperatures less the last
        one, which phonopy's differences consume).
    volume_temperature : numpy.ndarray, shape (N,)
        Equilibrium volume V(T), Å³.
    thermal_expansion : numpy.ndarray, shape (N,)
        Volumetric thermal expansion β(T) = (1/V) dV/dT, 1/K (first
        element 0).
    linear_thermal_expansion : numpy.ndarray, shape (N,)
        β/3, the mean linear coefficient α(T), 1/K.
    bulk_modulus_temperature : numpy.ndarray, shape (N,)
        Isothermal bulk modulus B(T), GPa.
    gibbs_temperature : numpy.ndarray, shape (N,)
        Gibbs energy G(T) at ``pressure`` (the Helmholtz energy F(T) at the
        equilibrium volume for zero pressure), eV.
    helmholtz_volume : numpy.ndarray, shape (N, n_volumes)
        F(V; T) = E(V) + F_phonon(V; T) [+ pV] at the sampled volumes, eV.
    entropy_temperature : numpy.ndarray, shape (N,)
        Entropy at constant pressure, eV/K.
    heat_capacity_P : numpy.ndarray, shape (N,)
        C_P(T), eV/K (first element 0).
    gruneisen_temperature : numpy.ndarray, shape (N,)
        Thermodynamic Grüneisen parameter (first element 0).
    eos : str
        phonopy's EOS of the F(V) fits.
    pressure : float
        Pressure of the Gibbs energy, GPa.
    cell : numpy.ndarray, shape (3, 3)
        Cell that was scaled (after ``relax_first``), Å.
    qha : phonopy.qha.QHAResult
        phonopy's result (per primitive cell); not written to JSON.
    phonopys : list of phonopy.Phonopy
        phonopy's object at each volume; not written to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "volumes": "Å^3",
        "energies": "eV",
        "min_frequencies": "THz",
        "temperatures": "K",
        "volume_temperature": "Å^3",
        "thermal_expansion": "1/K",
        "linear_thermal_expansion": "1/K",
        "bulk_modulus_temperature": "GPa",
        "gibbs_temperature": "eV",
        "helmholtz_volume": "eV",
        "entropy_temperature": "eV/K",
        "heat_capacity_P": "eV/K",
        "pressure": "GPa",
        "cell": "Å",
    }

    volumes: np.ndarray | None = None
    energies: np.ndarray | None = None
    relax_steps: np.ndarray | None = None
    n_displacements: np.ndarray | None = None
    min_frequencies: np.ndarray | None = None
    n_primitive_cells: int | None = None
    temperatures: np.ndarray | None = None
    volume_temperature: np.ndarray | None = None
    thermal_expansion: np.ndarray | None = None
    linear_thermal_expansion: np.ndarray | None = None
    bulk_modulus_temperature: np.ndarray | None = None
    gibbs_temperature: np.ndarray | None = None
    helmholtz_volume: np.ndarray | None = None
    entropy_temperature: np.ndarray | None = None
    heat_capacity_P: np.ndarray | None = None  # noqa: N815 (phonopy's name)
    gruneisen_temperature: np.ndarray | None = None
    eos: str = "vinet"
    pressure: float = 0.0
    cell: np.ndarray | None = None
    qha: Any = field(default=None, repr=False, metadata={"json": False})
    phonopys: list[Any] | None = field(
        default=None, repr=False, metadata={"json": False}
    )


def qha(
    images: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    n_volumes: int = 7,
    strain: float = 0.03,
    supercell: int | Sequence[int] | Sequence[Sequence[int]] = (2, 2, 2),
    displacement: float = 0.01,
    mesh: Sequence[int] = (11, 11, 11),
    temperatures: Sequence[float] | np.ndarray = DEFAULT_TEMPERATURES,
    eos: str = "vinet",
    pressure: float = 0.0,
    relax_first: bool = True,
    relax: Literal["ions"] | None = "ions",
    fmax: float = 1e-3,
    steps: int = 1000,
    optimizer: str = "FIRE",
    cell_optimizer: str = "FIRE2",
    primitive_matrix: str | Sequence[Sequence[float]] | None = "auto",
    symprec: float = 1e-5,
    imaginary_tolerance: float | None = IMAGINARY_TOLERANCE,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[QHAResult]:
    """Quasi-harmonic V(T), thermal expansion, B(T) and G(T) of every material.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The materials (periodic in three directions; never modified).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name, nvalchemi model or calculator.
    n_volumes : int
        Volumes per material (at least 5, phonopy's minimum).
    strain : float
        Largest linear strain: lattice vectors times
        ``numpy.linspace(1 - strain, 1 + strain, n_volumes)``, in (0, 0.5).
    supercell : int, 3 ints or 3x3 ints
        Phonon supercell of the input cell.
    displacement : float
        Displacement amplitude, Å.
    mesh : 3 ints
        q-mesh of the thermal properties (phonopy's: odd numbers are
        Γ-centred, even ones shifted by half a step).
    temperatures : sequence of float
        Ascending temperatures, K (at least 3; the last is consumed by
        phonopy's finite differences).
    eos : str
        ``"vinet"``, ``"birch_murnaghan"`` or ``"murnaghan"``.
    pressure : float
        Pressure, GPa (a pV term in the Gibbs energy).
    relax_first : bool
        Relax cell and ions of every material first (one batched run,
        ``FrechetCellFilter`` with ``cell_optimizer``, the space group kept
        by ``FixSymmetry``).
    relax : {"ions", None}
        Relax the ions at each scaled cell (one in-flight run; cells whose
        forces are already below ``fmax`` stay out) or not.
    fmax : float
        Force threshold of the relaxations, eV/Å.
    steps : int
        Step limit of each relaxation.
    optimizer : str
        Ion optimizer (``FIRE``, ``FIRE2``, ``LBFGS``, ``BFGS``).
    cell_optimizer : str
        Optimizer of ``relax_first``.
    primitive_matrix : "auto", "P", 3x3 floats or None
        phonopy's primitive cell (as :func:`~nvalchemi_ase.properties.phonons`).
    symprec : float
        Symmetry tolerance, Å.
    imaginary_tolerance : float or None
        A volume whose lowest mesh frequency is below ``-imaginary_tolerance``
        THz fails its material (the harmonic free energy is undefined); None:
        not checked (still reported).
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need.

    Returns
    -------
    list of QHAResult
        One per material, in input order; a failed material has ``error``
        set while the others are computed.

    Raises
    ------
    ImportError
        If phonopy or spglib is missing (names the extra to install).
    ValueError
        For invalid arguments.
    """
    require_phonopy()
    temps = _check_arguments(
        n_volumes,
        strain,
        temperatures,
        eos,
        relax,
        optimizer,
        cell_optimizer,
        displacement,
        imaginary_tolerance,
    )
    matrix = _supercell_matrix(supercell)
    mesh_array = _mesh(mesh)
    calc, _, ledger, references = prepared_materials(
        images,
        model,
        device=device,
        dtype=dtype,
        relax=relax_first,
        fmax=fmax,
        steps=steps,
        cell_optimizer=cell_optimizer,
        memory_budget=memory_budget,
        symprec=symprec,
    )
    factors = np.linspace(1.0 - strain, 1.0 + strain, n_volumes)
    volumes = _scaled_cells(references, factors, ledger)
    static, relax_steps = evaluate_or_relax(
        calc,
        volumes,
        ledger,
        ["energy"],
        relax=relax == "ions",
        fmax=fmax,
        steps=steps,
        optimizer=optimizer,
        memory_budget=memory_budget,
    )
    phonopys: dict[int, Any] = {}
    displaced: list[Derived] = []
    owner: list[int] = []  # which volume each displaced supercell belongs to
    for k, item in enumerate(volumes):
        build = partial(
            _displaced, item.atoms, matrix, displacement, primitive_matrix, symprec
        )
        phonon = ledger.guard(item.material, build, f"{item.label}: phonopy")
        if phonon is None:
            continue
        phonopys[k] = phonon
        cells = phonon.supercells_with_displacements
        for j, cell in enumerate(cells):
            label = f"{item.label}, displaced supercell {j + 1}/{len(cells)}"
            displaced.append(Derived(item.material, _to_ase(cell), label))
            owner.append(k)
    results = evaluate(calc, displaced, ["forces"], ledger, memory_budget=memory_budget)
    forces: dict[int, list[np.ndarray]] = {}
    for k, evaluated in zip(owner, results, strict=True):
        if evaluated is not None:
            forces.setdefault(k, []).append(evaluated["forces"])
    rows: dict[int, list[int]] = {}
    for k, item in enumerate(volumes):
        rows.setdefault(item.material, []).append(k)
    out = []
    for index, atoms in enumerate(references):
        result = QHAResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            eos=eos,
            pressure=float(pressure),
            cell=atoms.cell.array.copy(),
        )
        if ledger.alive(index):
            mine = rows[index]
            result.volumes = np.array([volumes[k].atoms.get_volume() for k in mine])
            result.energies = gather(static, mine, "energy")
            result.relax_steps = relax_steps[mine]
            ledger.guard(
                index,
                partial(
                    _phonons_per_volume,
                    result,
                    [phonopys[k] for k in mine],
                    [forces[k] for k in mine],
                    mesh_array,
                ),
                "phonopy's force constants",
            )
            _check_imaginary(result, ledger, imaginary_tolerance, volumes, mine)
            ledger.guard(
                index,
                partial(_run_qha, result, temps, mesh_array),
                "phonopy's quasi-harmonic fit",
            )
        result.error = ledger.errors.get(index)
        out.append(result)
    return out


def _check_arguments(
    n_volumes: int,
    strain: float,
    temperatures: Sequence[float] | np.ndarray,
    eos: str,
    relax: str | None,
    optimizer: str,
    cell_optimizer: str,
    displacement: float,
    imaginary_tolerance: float | None,
) -> np.ndarray:
    if int(n_volumes) != n_volumes or n_volumes < 5:
        raise ValueError(f"n_volumes must be an integer >= 5, got {n_volumes}")
    if not 0 < strain < 0.5:
        raise ValueError(f"strain must be in (0, 0.5) (linear, ±), got {strain}")
    temps = np.asarray(temperatures, dtype=float)
    if temps.ndim != 1 or temps.size < 3 or not np.isfinite(temps).all():
        raise ValueError(
            f"temperatures must be at least 3 finite numbers, K; got {temperatures}"
        )
    if (temps < 0).any() or (np.diff(temps) <= 0).any():
        raise ValueError("temperatures must be >= 0 K and strictly ascending")
    if eos not in QHA_EOS:
        raise ValueError(f"eos must be one of {', '.join(QHA_EOS)}, got {eos!r}")
    if relax not in ("ions", None):
        raise ValueError(f"relax must be 'ions' or None, got {relax!r}")
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
    if not displacement > 0:
        raise ValueError(f"displacement must be positive (Å), got {displacement}")
    if imaginary_tolerance is not None and not imaginary_tolerance > 0:
        raise ValueError(
            f"imaginary_tolerance must be positive (THz) or None, got "
            f"{imaginary_tolerance}"
        )
    return temps


def _phonons_per_volume(
    result: QHAResult,
    phonopys: list[Any],
    forces: list[list[np.ndarray]],
    mesh: np.ndarray,
) -> None:
    """Force constants and the lowest mesh frequency at every volume."""
    lowest = []
    for phonon, volume_forces in zip(phonopys, forces, strict=True):
        phonon.forces = np.array(volume_forces)
        phonon.produce_force_constants()
        phonon.run_mesh(mesh, is_gamma_center=True)
        lowest.append(float(np.min(phonon.mesh.frequencies)))
    result.phonopys = phonopys
    result.n_displacements = np.array([len(f) for f in forces])
    result.min_frequencies = np.array(lowest)
    first = phonopys[0]
    result.n_primitive_cells = round(len(first.unitcell) / len(first.primitive))


def _check_imaginary(
    result: QHAResult,
    ledger: Ledger,
    tolerance: float | None,
    volumes: Sequence[Derived],
    rows: list[int],
) -> None:
    if tolerance is None or result.min_frequencies is None:
        return
    bad = np.flatnonzero(result.min_frequencies < -tolerance)
    if bad.size:
        k = int(bad[0])
        ledger.fail(
            result.index,
            f"{volumes[rows[k]].label}: imaginary phonon modes (lowest "
            f"{result.min_frequencies[k]:.3g} THz < -imaginary_tolerance "
            f"{tolerance:g}); the harmonic free energy is undefined there: narrow "
            "strain or relax the material first",
        )


def _run_qha(result: QHAResult, temperatures: np.ndarray, mesh: np.ndarray) -> None:
    """Run phonopy's QHA on the result's volumes; convert to the input cell."""
    from phonopy import run_qha

    cells = result.n_primitive_cells or 1
    if result.energies is None or result.phonopys is None:
        raise ValueError("no energies or phonons to fit")
    fit = run_qha(
        result.phonopys,
        temperatures,
        internal_energies=result.energies / cells,
        mesh=mesh,
        pressure=result.pressure,
        eos=result.eos,
        # the three zero modes at Γ: kT log(hν/kT) of a ~1e-7 THz mode is a
        # spurious, noise-driven free energy (phonopy warns and offers this)
        exclude_gamma_acoustic=True,
    )
    result.qha = fit
    result.temperatures = np.asarray(fit.temperatures)
    result.volume_temperature = np.asarray(fit.equilibrium_volumes) * cells
    result.thermal_expansion = np.asarray(fit.thermal_expansion)
    result.linear_thermal_expansion = result.thermal_expansion / 3.0
    result.bulk_modulus_temperature = np.asarray(fit.bulk_moduli) / units.GPa
    result.gibbs_temperature = np.asarray(fit.gibbs_free_energies) * cells
    result.helmholtz_volume = np.asarray(fit.helmholtz_volume) * cells
    result.entropy_temperature = np.asarray(fit.entropy_temperature) * cells
    result.heat_capacity_P = np.asarray(fit.heat_capacity_P.heat_capacities) * cells
    result.gruneisen_temperature = np.asarray(fit.gruneisen_parameters)
