"""Lattice thermal conductivity of many materials at once (phono3py).

phono3py (extra ``nvalchemi-ase[kappa]``) builds each material's supercell
and its symmetry-reduced displaced copies, one atom displaced (FC2 and FC3)
or two (FC3); the forces on every displaced supercell of every material come
from batched ``calculate_batch`` calls in one stream across materials, as
few as the memory budget allows; phono3py then builds the second- and
third-order force constants and solves the phonon Boltzmann transport
equation on a q-mesh, in the relaxation-time approximation (``"rta"``) or
directly (``"lbte"``). κ is in W/(m K).

Two checks make a wrong force set visible instead of a wrong κ:

* **translational invariance** per displaced supercell: the forces of a
  periodic cell sum to zero for any model whose forces are the gradient of
  an energy that does not change when every atom moves together; a cell
  whose ``|Σ_i F_i|`` exceeds ``force_sum_tolerance`` fails its material,
  naming the cell;
* **the acoustic sum rule at Γ**: the three acoustic frequencies of the
  raw (not symmetrized) second-order force constants must vanish; above
  ``acoustic_tolerance`` the material fails before the BTE is solved.

Both numbers are kept in every result, failed or not.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from ase import Atoms

from nvalchemi_ase.properties._common import (
    VARIABLE_CELL_OPTIMIZERS,
    Derived,
    Ledger,
    MaterialResult,
    evaluate,
    prepared_materials,
)
from nvalchemi_ase.properties.phonons import (
    _frequencies,
    _mesh,
    _primitive,
    _supercell_matrix,
    _to_ase,
)

if TYPE_CHECKING:
    import torch
    from nvalchemi.models.base import BaseModelMixin

    from nvalchemi_ase.calculator import NVAlchemiCalculator
    from nvalchemi_ase.devices import DtypeLike

__all__ = [
    "ACOUSTIC_TOLERANCE",
    "FORCE_SUM_TOLERANCE",
    "ThermalConductivityResult",
    "acoustic_check",
    "require_phono3py",
    "thermal_conductivity",
]

#: How to install what thermal conductivity needs.
INSTALL_HINT = (
    "thermal conductivity needs phono3py (with phonopy and spglib): "
    "pip install 'nvalchemi-ase[kappa]' (or pip install phono3py)"
)

#: Default largest ``|Σ_i F_i|`` of one displaced supercell, eV/Å.
FORCE_SUM_TOLERANCE = 1e-3
#: Default largest acoustic frequency at Γ of the raw FC2, THz.
ACOUSTIC_TOLERANCE = 0.05

Method = Literal["rta", "lbte"]


@dataclass
class ThermalConductivityResult(MaterialResult):
    """Lattice thermal conductivity of one material, with its checks.

    Attributes
    ----------
    supercell_matrix : numpy.ndarray of int, shape (3, 3)
        Supercell of the (relaxed) input cell for FC3 (and FC2 unless
        ``fc2_supercell_matrix`` is set).
    fc2_supercell_matrix : numpy.ndarray of int, shape (3, 3) or None
        Separate supercell for FC2 (None: the FC3 one).
    displacement : float
        Displacement amplitude, Å.
    method : str
        ``"rta"`` or ``"lbte"``.
    mesh : numpy.ndarray of int, shape (3,)
        q-mesh of the BTE.
    temperatures : numpy.ndarray, shape (T,)
        Temperatures, K.
    kappa : numpy.ndarray, shape (T, 3, 3)
        Lattice thermal conductivity tensor at each temperature, W/(m K).
    kappa_mean : numpy.ndarray, shape (T,)
        ``trace(kappa) / 3``, W/(m K).
    n_fc3_displacements : int
        Displaced supercells for FC3 (evaluated; pairs beyond
        ``cutoff_pair_distance`` are not).
    n_fc2_displacements : int
        Displaced supercells for FC2 (0 when FC2 comes from the FC3 set).
    force_sums : numpy.ndarray, shape (n_fc3_displacements + n_fc2_displacements,)
        ``|Σ_i F_i|`` of every evaluated displaced supercell (FC3 cells
        first), eV/Å; ~0 for a translation-invariant model.
    max_force_sum : float
        Largest of them, eV/Å.
    residual_force : float
        Largest force on the undisplaced supercell, eV/Å (how far from
        equilibrium the cell was; the force constants assume ~0).
    gamma_frequencies : numpy.ndarray, shape (3 N_prim,)
        Frequencies at Γ from the raw FC2, THz (imaginary negative).
    acoustic_gamma : float
        Largest ``|f|`` of the three acoustic modes at Γ, THz (~0 by the
        acoustic sum rule).
    fc2_sum_rule : float
        Largest ``|Σ_j Φ_ij^{αβ}|`` of the raw FC2, eV/Å².
    cell : numpy.ndarray, shape (3, 3)
        Cell the supercells were built from (after ``relax``), Å.
    atoms : ase.Atoms
        That structure; not written to JSON.
    phono3py : phono3py.Phono3py
        phono3py's object with forces, force constants and the conductivity
        solver (mode κ, lifetimes, ``save``); not written to JSON.
    """

    UNITS: ClassVar[dict[str, str]] = {
        "displacement": "Å",
        "temperatures": "K",
        "kappa": "W/(m K)",
        "kappa_mean": "W/(m K)",
        "force_sums": "eV/Å",
        "max_force_sum": "eV/Å",
        "residual_force": "eV/Å",
        "gamma_frequencies": "THz",
        "acoustic_gamma": "THz",
        "fc2_sum_rule": "eV/Å^2",
        "cell": "Å",
    }

    supercell_matrix: np.ndarray | None = None
    fc2_supercell_matrix: np.ndarray | None = None
    displacement: float | None = None
    method: str = "rta"
    mesh: np.ndarray | None = None
    temperatures: np.ndarray | None = None
    kappa: np.ndarray | None = None
    kappa_mean: np.ndarray | None = None
    n_fc3_displacements: int | None = None
    n_fc2_displacements: int | None = None
    force_sums: np.ndarray | None = None
    max_force_sum: float | None = None
    residual_force: float | None = None
    gamma_frequencies: np.ndarray | None = None
    acoustic_gamma: float | None = None
    fc2_sum_rule: float | None = None
    cell: np.ndarray | None = None
    atoms: Atoms | None = field(default=None, repr=False, metadata={"json": False})
    phono3py: Any = field(default=None, repr=False, metadata={"json": False})


def require_phono3py() -> None:
    """Raise ImportError naming the extra when phono3py is missing.

    Raises
    ------
    ImportError
        If ``phono3py``, ``phonopy`` or ``spglib`` cannot be imported.
    """
    missing = [
        name
        for name in ("phono3py", "phonopy", "spglib")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise ImportError(f"{' and '.join(missing)} not installed; {INSTALL_HINT}")


def thermal_conductivity(
    images: Atoms | Sequence[Atoms],
    model: str | BaseModelMixin | NVAlchemiCalculator,
    *,
    supercell: int | Sequence[int] | Sequence[Sequence[int]] = (2, 2, 2),
    fc2_supercell: int | Sequence[int] | Sequence[Sequence[int]] | None = None,
    mesh: Sequence[int] = (11, 11, 11),
    temperatures: float | Sequence[float] | np.ndarray = (300.0,),
    displacement: float = 0.03,
    method: Method = "rta",
    cutoff_pair_distance: float | None = None,
    is_isotope: bool = False,
    primitive_matrix: str | Sequence[Sequence[float]] | None = "auto",
    symprec: float = 1e-5,
    relax: bool = True,
    fmax: float = 1e-3,
    steps: int = 1000,
    cell_optimizer: str = "FIRE2",
    force_sum_tolerance: float | None = FORCE_SUM_TOLERANCE,
    acoustic_tolerance: float | None = ACOUSTIC_TOLERANCE,
    device: torch.device | str | None = None,
    dtype: DtypeLike = None,
    memory_budget: float | None = None,
) -> list[ThermalConductivityResult]:
    """Lattice thermal conductivity of every material, all supercells batched.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        The materials (periodic in three directions; never modified).
    model : str, BaseModelMixin or NVAlchemiCalculator
        Model name, nvalchemi model or calculator.
    supercell : int, 3 ints or 3x3 ints
        Supercell of each (relaxed) input cell for FC3.
    fc2_supercell : int, 3 ints, 3x3 ints or None
        A separate (usually larger) supercell for FC2; None: FC2 from the
        FC3 supercells.
    mesh : 3 ints
        q-mesh of the BTE.
    temperatures : float or sequence of float
        Temperatures, K (> 0).
    displacement : float
        Displacement amplitude, Å.
    method : {"rta", "lbte"}
        Relaxation-time approximation or the direct solution of the
        linearized BTE (phono3py's ``is_LBTE``).
    cutoff_pair_distance : float, optional
        Leave out FC3 pairs of displaced atoms farther apart than this, Å
        (phono3py's; fewer supercells).
    is_isotope : bool
        Add isotope scattering (natural abundances).
    primitive_matrix : "auto", "P", 3x3 floats or None
        phono3py's primitive cell in terms of the input cell (as
        :func:`~nvalchemi_ase.properties.phonons`).
    symprec : float
        Symmetry tolerance, Å.
    relax : bool
        Relax cell and ions of every material first (one batched run,
        ``FrechetCellFilter`` with ``cell_optimizer``, the space group kept
        by ``FixSymmetry``): force constants assume a cell at equilibrium.
    fmax : float
        Force threshold of that relaxation, eV/Å.
    steps : int
        Its step limit.
    cell_optimizer : str
        ``FIRE2`` (default), ``LBFGS``, ``FIRE`` or ``BFGS``.
    force_sum_tolerance : float or None
        Largest ``|Σ_i F_i|`` allowed on one displaced supercell, eV/Å;
        None: not checked (still reported).
    acoustic_tolerance : float or None
        Largest ``|f|`` of the acoustic modes at Γ of the raw FC2, THz;
        None: not checked (still reported).
    device, dtype
        For a model given by name or object.
    memory_budget : float, optional
        Bytes a batch may be estimated to need (default: half of the memory
        free on the device).

    Returns
    -------
    list of ThermalConductivityResult
        One per material, in input order; a failed material has ``error``
        set (the checks' numbers are kept when they were computed) while
        the others are computed.

    Raises
    ------
    ImportError
        If phono3py is missing (names the extra to install).
    ValueError
        For invalid arguments.
    """
    require_phono3py()
    temps = _check_arguments(
        temperatures,
        displacement,
        method,
        cutoff_pair_distance,
        primitive_matrix,
        cell_optimizer,
        force_sum_tolerance,
        acoustic_tolerance,
    )
    matrix = _supercell_matrix(supercell)
    fc2_matrix = None if fc2_supercell is None else _supercell_matrix(fc2_supercell)
    mesh_array = _mesh(mesh)
    calc, _, ledger, references = prepared_materials(
        images,
        model,
        device=device,
        dtype=dtype,
        relax=relax,
        fmax=fmax,
        steps=steps,
        cell_optimizer=cell_optimizer,
        memory_budget=memory_budget,
        symprec=symprec,
    )
    plans: dict[int, _Plan] = {}
    derived: list[Derived] = []
    for index, atoms in enumerate(references):
        build = partial(
            _displaced,
            atoms,
            matrix,
            fc2_matrix,
            displacement,
            cutoff_pair_distance,
            primitive_matrix,
            symprec,
        )
        plan = ledger.guard(index, build, "building the displaced supercells")
        if plan is not None:
            plans[index] = plan
            derived.extend(plan.derived(index))
    results = evaluate(calc, derived, ["forces"], ledger, memory_budget=memory_budget)
    forces: dict[int, list[np.ndarray]] = {}
    for item, evaluated in zip(derived, results, strict=True):
        if evaluated is not None:
            forces.setdefault(item.material, []).append(evaluated["forces"])
    out = []
    for index, atoms in enumerate(references):
        result = ThermalConductivityResult(
            index=index,
            formula=atoms.get_chemical_formula(),
            natoms=len(atoms),
            supercell_matrix=matrix,
            fc2_supercell_matrix=fc2_matrix,
            displacement=float(displacement),
            method=method,
            mesh=mesh_array,
            temperatures=temps,
            cell=atoms.cell.array.copy(),
            atoms=atoms,
        )
        if ledger.alive(index):
            plan = plans[index]
            plan.check_forces(result, forces[index], ledger, force_sum_tolerance)
            ledger.guard(
                index,
                partial(plan.force_constants, result),
                "phono3py's force constants",
            )
            if ledger.alive(index):
                _check_acoustic(result, ledger, acoustic_tolerance)
            ledger.guard(
                index,
                partial(_solve, result, plan.phono3py, mesh_array, is_isotope),
                f"phono3py's {method.upper()} solution",
            )
        result.error = ledger.errors.get(index)
        if result.error is not None:
            result.kappa = result.kappa_mean = result.phono3py = None
        out.append(result)
    return out


def _unitcell(atoms: Atoms) -> Any:
    """Build phonopy's cell from ASE's wrapped fractions (as its readers do).

    In a small supercell an atom half a supercell away from another has
    equidistant images, and phono3py's choice among them follows the last
    bits of the fractions: an unwrapped fraction (a relaxed ``-1e-17``) or
    one rounded through Cartesian coordinates moves κ at the percent level.
    """
    from phonopy.structure.atoms import PhonopyAtoms

    return PhonopyAtoms(
        symbols=atoms.get_chemical_symbols(),
        cell=atoms.cell.array,
        scaled_positions=atoms.get_scaled_positions(wrap=True),
        masses=atoms.get_masses(),
    )


def _check_arguments(
    temperatures: float | Sequence[float] | np.ndarray,
    displacement: float,
    method: str,
    cutoff_pair_distance: float | None,
    primitive_matrix: Any,
    cell_optimizer: str,
    force_sum_tolerance: float | None,
    acoustic_tolerance: float | None,
) -> np.ndarray:
    """Validate the arguments; return the temperatures as an array."""
    temps = np.atleast_1d(np.asarray(temperatures, dtype=float))
    if temps.ndim != 1 or temps.size == 0 or not (np.isfinite(temps).all()):
        raise ValueError(f"temperatures must be finite numbers, K; got {temperatures}")
    if (temps <= 0).any():
        raise ValueError(f"temperatures must be positive, K; got {temps.tolist()}")
    if not displacement > 0:
        raise ValueError(f"displacement must be positive (Å), got {displacement}")
    if method not in ("rta", "lbte"):
        raise ValueError(f"method must be 'rta' or 'lbte', got {method!r}")
    if cutoff_pair_distance is not None and not cutoff_pair_distance > 0:
        raise ValueError(
            f"cutoff_pair_distance must be positive (Å) or None, got "
            f"{cutoff_pair_distance}"
        )
    if isinstance(primitive_matrix, str) and primitive_matrix not in ("auto", "P"):
        raise ValueError(
            f"primitive_matrix must be 'auto', 'P', None or a 3x3 matrix, got "
            f"{primitive_matrix!r}"
        )
    if cell_optimizer not in VARIABLE_CELL_OPTIMIZERS:
        raise ValueError(
            f"cell_optimizer must be one of {', '.join(VARIABLE_CELL_OPTIMIZERS)}, "
            f"got {cell_optimizer!r}"
        )
    for name, value in (
        ("force_sum_tolerance", force_sum_tolerance),
        ("acoustic_tolerance", acoustic_tolerance),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive or None, got {value}")
    return temps


@dataclass
class _Plan:
    """One material's phono3py object and which of its supercells are evaluated."""

    phono3py: Any
    fc3_cells: list[Any]  # phono3py's list (None: a pair left out by the cutoff)
    fc2_cells: list[Any]

    def derived(self, material: int) -> list[Derived]:
        """List the perfect supercell, then the evaluated FC3 and FC2 cells."""
        items = [Derived(material, _to_ase(self.phono3py.supercell), "perfect cell")]
        kept = [k for k, cell in enumerate(self.fc3_cells) if cell is not None]
        items.extend(
            Derived(
                material,
                _to_ase(self.fc3_cells[k]),
                f"FC3 displaced supercell {k + 1}/{len(self.fc3_cells)}",
            )
            for k in kept
        )
        items.extend(
            Derived(
                material,
                _to_ase(cell),
                f"FC2 displaced supercell {k + 1}/{len(self.fc2_cells)}",
            )
            for k, cell in enumerate(self.fc2_cells)
        )
        return items

    def check_forces(
        self,
        result: ThermalConductivityResult,
        forces: list[np.ndarray],
        ledger: Ledger,
        tolerance: float | None,
    ) -> None:
        """Residual force, per-cell force sums, then the forces into phono3py."""
        kept = [k for k, cell in enumerate(self.fc3_cells) if cell is not None]
        perfect = forces[0]
        fc3 = np.array(forces[1 : 1 + len(kept)]).reshape(len(kept), *perfect.shape)
        fc2 = forces[1 + len(kept) :]
        result.residual_force = float(np.linalg.norm(perfect, axis=1).max())
        result.n_fc3_displacements = len(kept)
        result.n_fc2_displacements = len(self.fc2_cells)
        sums = np.array([np.linalg.norm(f.sum(axis=0)) for f in [*fc3, *fc2]])
        result.force_sums = sums
        result.max_force_sum = float(sums.max(initial=0.0))
        if tolerance is not None and result.max_force_sum > tolerance:
            worst = int(np.argmax(sums))
            labels = [f"FC3 displaced supercell {k + 1}" for k in kept] + [
                f"FC2 displaced supercell {k + 1}" for k in range(len(self.fc2_cells))
            ]
            bad = int((sums > tolerance).sum())
            ledger.fail(
                result.index,
                f"translational invariance broken: the forces on {labels[worst]} "
                f"sum to {sums[worst]:.3g} eV/Å (> force_sum_tolerance "
                f"{tolerance:g}; {bad} of {len(sums)} supercells above it); the "
                "model's forces are not those of a translation-invariant energy",
            )
            return
        fc3_forces = np.zeros((len(self.fc3_cells), *perfect.shape))
        fc3_forces[kept] = fc3
        self.phono3py.forces = fc3_forces
        if self.fc2_cells:
            self.phono3py.phonon_forces = np.array(fc2)

    def force_constants(self, result: ThermalConductivityResult) -> None:
        """FC3 and FC2 (traditional, not symmetrized), the FC2 checks."""
        ph3 = self.phono3py
        ph3.produce_fc3()
        if self.fc2_cells:
            ph3.produce_fc2()
        result.fc2_sum_rule, result.gamma_frequencies = acoustic_check(ph3)
        result.acoustic_gamma = float(np.sort(np.abs(result.gamma_frequencies))[2])


def acoustic_check(ph3: Any) -> tuple[float, np.ndarray]:
    """Measure the acoustic sum rule of a phono3py FC2 and its Γ frequencies.

    Parameters
    ----------
    ph3 : phono3py.Phono3py
        With ``fc2`` produced (compact or full).

    Returns
    -------
    sum_rule : float
        Largest ``|Σ_j Φ_ij^{αβ}|`` over atoms ``i`` of the primitive cell
        and Cartesian pairs, eV/Å² (0 for translation-invariant FC2).
    gamma_frequencies : numpy.ndarray, shape (3 N_prim,)
        Frequencies at Γ, THz (imaginary negative); the three acoustic ones
        are ~0 when the rule holds.
    """
    from phonopy import Phonopy

    fc2 = np.asarray(ph3.fc2)
    phonon = Phonopy(
        ph3.unitcell,
        supercell_matrix=(
            ph3.supercell_matrix
            if ph3.phonon_supercell_matrix is None
            else ph3.phonon_supercell_matrix
        ),
        primitive_matrix=ph3.primitive_matrix,
        symprec=ph3.symmetry.tolerance,
    )
    phonon.force_constants = fc2
    frequencies = _frequencies(phonon, np.zeros((1, 3)))[0]
    if fc2.shape[0] != fc2.shape[1]:  # compact: rows are the primitive atoms
        rows = fc2
    else:
        rows = fc2[np.asarray(phonon.primitive.p2s_map)]
    return float(np.abs(rows.sum(axis=1)).max()), frequencies


def _check_acoustic(
    result: ThermalConductivityResult, ledger: Ledger, tolerance: float | None
) -> None:
    if tolerance is None or result.acoustic_gamma is None:
        return
    if result.acoustic_gamma > tolerance:
        ledger.fail(
            result.index,
            f"acoustic sum rule broken: an acoustic mode at Γ of the raw FC2 has "
            f"|f| = {result.acoustic_gamma:.3g} THz (> acoustic_tolerance "
            f"{tolerance:g}; largest |Σ_j Φ_ij| = {result.fc2_sum_rule:.3g} eV/Å², "
            f"largest |Σ F| of a displaced cell {result.max_force_sum:.3g} eV/Å)",
        )


def _displaced(
    atoms: Atoms,
    matrix: np.ndarray,
    fc2_matrix: np.ndarray | None,
    displacement: float,
    cutoff_pair_distance: float | None,
    primitive_matrix: Any,
    symprec: float,
) -> _Plan:
    from phono3py import Phono3py

    unitcell = _unitcell(atoms)
    ph3 = Phono3py(
        unitcell,
        supercell_matrix=matrix,
        phonon_supercell_matrix=fc2_matrix,
        primitive_matrix=_primitive(unitcell, primitive_matrix, symprec),
        symprec=symprec,
    )
    ph3.generate_displacements(
        distance=displacement, cutoff_pair_distance=cutoff_pair_distance
    )
    if fc2_matrix is not None:
        ph3.generate_fc2_displacements(distance=displacement)
    fc2_cells = (
        list(ph3.phonon_supercells_with_displacements) if fc2_matrix is not None else []
    )
    return _Plan(ph3, list(ph3.supercells_with_displacements), fc2_cells)


def _solve(
    result: ThermalConductivityResult,
    ph3: Any,
    mesh: np.ndarray,
    is_isotope: bool,
) -> None:
    """Solve the BTE on ``mesh`` at the result's temperatures."""
    ph3.mesh_numbers = mesh
    ph3.init_phph_interaction()
    ph3.run_thermal_conductivity(
        is_LBTE=result.method == "lbte",
        temperatures=result.temperatures,
        is_isotope=is_isotope,
    )
    voigt = np.asarray(ph3.thermal_conductivity.kappa)[0]  # first (only) sigma
    result.kappa = voigt_to_tensor(voigt)
    result.kappa_mean = np.trace(result.kappa, axis1=1, axis2=2) / 3.0
    result.phono3py = ph3


def voigt_to_tensor(voigt: np.ndarray) -> np.ndarray:
    """phono3py's (xx, yy, zz, yz, xz, xy) rows as symmetric 3x3 tensors.

    Parameters
    ----------
    voigt : numpy.ndarray, shape (..., 6)
        Components in that order.

    Returns
    -------
    numpy.ndarray, shape (..., 3, 3)
        The tensors.
    """
    voigt = np.asarray(voigt, dtype=float)
    tensor = np.empty((*voigt.shape[:-1], 3, 3))
    for k, (i, j) in enumerate(((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))):
        tensor[..., i, j] = tensor[..., j, i] = voigt[..., k]
    return tensor
