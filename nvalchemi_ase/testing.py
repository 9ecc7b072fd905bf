"""Conformance checks for nvalchemi models, run through :class:`NVAlchemiCalculator`.

A model author who wraps a potential as an nvalchemi ``BaseModelMixin`` can
check in one call that ASE users will get consistent numbers from it::

    from nvalchemi_ase.testing import check_model
    from my_package import MyModelWrapper

    model = MyModelWrapper.from_checkpoint("weights.pt")
    report = check_model(model, elements=("Cu", "Ni"), dtype="float64")
    print(report)  # {'outputs': 'passed (5 structures)', 'forces': ...}

or, in a pytest suite, one check at a time::

    import pytest
    from nvalchemi_ase import testing

    STRUCTURES = testing.default_structures(elements=("Cu", "Ni"))

    @pytest.mark.parametrize("check", sorted(testing.CHECKS))
    def test_conformance(check, my_model):
        testing.CHECKS[check](my_model, STRUCTURES, dtype="float64")

(``stress`` raises ``ValueError`` for a model without stress output;
``check_model`` skips it.)

``check_model`` raises one ``AssertionError`` listing every failed check, each
naming the structure index, the property and the largest deviation.

What is checked
---------------
==============  ==================================================  ================
name            check                                               applies when
==============  ==================================================  ================
``outputs``     :func:`check_output_shapes`: energy a finite        always
                float, forces (N, 3), stress (6,), all float64,
                fresh copies
``forces``      :func:`check_forces_match_finite_differences`:      always
                central differences of the energy (ASE's
                ``calculate_numerical_forces``)
``stress``      :func:`check_stress_matches_finite_differences`:    the model outputs
                strain derivative of the energy (ASE's              stress
                ``calculate_numerical_stress``)
``batch``       :func:`check_batch_matches_single`: one batched     always
                call equals one call per structure
``translation`` :func:`check_translation_invariance`: a rigid       ``translation_
                translation changes nothing; net force is zero      invariant``
``lattice``     :func:`check_lattice_invariance`: moving atoms by   ``periodic``
                lattice vectors and wrapping them into the cell
                change nothing
``one_atom``    :func:`check_one_atom_cells`: 1-atom periodic,      always (zero
                2D-periodic and isolated structures evaluate;       force only when
                their force is zero                                 ``translation_
                                                                    invariant``)
``stress_rank`` :func:`check_stress_only_for_full_cells`: stress    always
                (6,) for cells of rank 3, ASE's
                ``PropertyNotImplementedError`` otherwise
``mutation``    :func:`check_no_input_mutation`: positions, cell,   always
                numbers, arrays, info, constraints and calculator
                of the user's ``Atoms`` bit-for-bit unchanged
==============  ==================================================  ================

Every check except ``batch`` evaluates one structure at a time through ASE's
calculator protocol (``calc.get_forces(atoms)``), so a batching bug shows up in
the ``batch`` check alone. Not every model is meant to pass every check:
nvalchemi's demo model is a point cloud (``supports_pbc=False``, not
translation invariant), so it is checked with ``periodic=False,
translation_invariant=False``; ``periodic=None`` (the default) takes the model's
own ``model_config.supports_pbc``. ``skip=`` leaves out checks by name.

Tolerances
----------
Named per dtype in :data:`TOLERANCES` (a :class:`Tolerances` each; pass
``tolerances=dataclasses.replace(TOLERANCES[torch.float32], ...)`` to change
one). Finite differences of an energy E computed with machine epsilon ε and
step h have a rounding error of about ε·|E|/h and a truncation error of about
h²·|F'''|/6; the steps balance the two for energies of a few to a few hundred
eV:

* **float64** (ε = 2.2e-16): step 1e-5 Å, strain 1e-6. Rounding (≈ 1e-10 eV/Å
  for |E| = 10 eV) and truncation (≈ 1e-11·|F'''|) sit far below the allowed
  1e-6 eV/Å + 1e-6·max|F| (forces) and 1e-8 eV/Å³ + 1e-6·max|σ| (stress).
  LJ argon deviates by ≈ 2e-11 eV/Å and 1e-12 eV/Å³; forces 1 % too large
  (|F| ≈ 0.05 eV/Å) deviate by ≈ 5e-4 eV/Å and fail by a factor of 500.
* **float32** (ε = 1.2e-7): step 1e-3 Å, strain 1e-4, a compromise between
  rounding (ε·|E|/h ≈ 1.2e-4·|E| eV/Å) and truncation; allowed 1e-3 eV/Å +
  1e-3·max|F| and 1e-5 eV/Å³ + 1e-3·max|σ|, plus a rounding allowance of
  ``fd_rounding`` (4) × ε·|E|/h (ε·|E|/(strain·V) for stress) per structure,
  so that the bound grows with the total energy instead of failing every
  large structure. LJ argon deviates by ≤ 6e-5 eV/Å and 4e-6 eV/Å³;
  SevenNet-0 on a 16-atom Cu/Ni crystal (E = -78 eV) by 4e-3 eV/Å (allowed
  0.04) and 4e-4 eV/Å³ (allowed 2e-3). float32 finite differences are a
  loose sanity check: check a model's derivatives in float64 (nvalchemi models
  convert with ``model.to(dtype=torch.float64)``).
* Two evaluations that should agree (batched vs single, translated vs not):
  ``rtol`` 1e-10 (float64) / 1e-5 (float32) of the largest component, plus
  absolute floors of 1e-10 eV/atom, 1e-10 eV/Å, 1e-12 eV/Å³ (float64) and
  1e-5 eV/atom, 1e-4 eV/Å, 1e-6 eV/Å³ (float32). In float64 the differences
  are round-off of reordered sums (LJ: ≤ 1e-15 eV/Å); in float32 positions
  are rounded to float32 after a translation (≈ 1e-6 Å at 20 Å, times force
  constants of up to tens of eV/Å² for a stiff model; LJ: ≤ 2e-7 eV/Å).

Structures
----------
:func:`default_structures` builds, for any ``elements``: a rattled 16-atom fcc
crystal, a rattled triclinic 8-atom cell, a rattled fcc(111) slab with vacuum
(pbc T, T, F), a 13-atom cluster (no cell, no pbc) and a 1-atom fcc cell, all
at the elements' reference nearest-neighbour distance
(:func:`neighbour_distance`), so element-restricted models can be checked on
the species they know. Lennard-Jones ignores atomic numbers; the default
element is argon, whose spacing matches ``load_model("lj")``.

Every evaluation goes through :class:`NVAlchemiCalculator`, which leaves the
model object you pass unchanged: when ``device`` or ``dtype`` differ from the
model's own, it evaluates a copy.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk, fcc111
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress
from ase.calculators.singlepoint import SinglePointCalculator
from ase.cluster import Icosahedron
from ase.constraints import FixAtoms
from ase.data import atomic_numbers, covalent_radii, reference_states

from nvalchemi_ase.calculator import NVAlchemiCalculator
from nvalchemi_ase.convert import as_atoms_list
from nvalchemi_ase.devices import DtypeLike
from nvalchemi_ase.models import resolve_model

if TYPE_CHECKING:
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "CHECKS",
    "TOLERANCES",
    "Tolerances",
    "check_batch_matches_single",
    "check_forces_match_finite_differences",
    "check_lattice_invariance",
    "check_model",
    "check_no_input_mutation",
    "check_one_atom_cells",
    "check_output_shapes",
    "check_stress_matches_finite_differences",
    "check_stress_only_for_full_cells",
    "check_translation_invariance",
    "default_structures",
    "neighbour_distance",
    "one_atom_structures",
]

Structures = Atoms | Sequence[Atoms] | None


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Named tolerances of the checks, for one floating dtype.

    A deviation passes when it is at most ``atol + rtol * max|reference|``
    (the largest component of the reference, so small components of a large
    vector are not held to a relative bound). See the module docstring for
    the values and why.

    Attributes
    ----------
    fd_step : float
        Displacement of finite-difference forces, Å.
    fd_strain : float
        Strain of finite-difference stress (dimensionless).
    fd_force_atol : float
        Absolute allowance, finite-difference forces, eV/Å.
    fd_stress_atol : float
        Absolute allowance, finite-difference stress, eV/Å³.
    fd_rtol : float
        Relative allowance of finite differences, of the largest analytic
        component.
    fd_rounding : float
        Rounding allowance, in units of ``eps * |E| / fd_step`` eV/Å (forces)
        and ``eps * |E| / (fd_strain * V)`` eV/Å³ (stress), ``eps`` the
        dtype's machine epsilon and E the structure's energy.
    rtol : float
        Relative allowance between two evaluations that should agree
        (batched vs single, translated vs not).
    energy_atol : float
        Absolute allowance between two such energies, eV per atom.
    force_atol : float
        Absolute allowance between two such forces (and of a force that
        should be zero), eV/Å.
    stress_atol : float
        Absolute allowance between two such stresses, eV/Å³.
    """

    fd_step: float
    fd_strain: float
    fd_force_atol: float
    fd_stress_atol: float
    fd_rtol: float
    fd_rounding: float
    rtol: float
    energy_atol: float
    force_atol: float
    stress_atol: float


#: The tolerances of every check, per dtype (values and reasons in the module
#: docstring).
TOLERANCES: dict[torch.dtype, Tolerances] = {
    torch.float64: Tolerances(
        fd_step=1e-5,
        fd_strain=1e-6,
        fd_force_atol=1e-6,
        fd_stress_atol=1e-8,
        fd_rtol=1e-6,
        fd_rounding=4.0,
        rtol=1e-10,
        energy_atol=1e-10,
        force_atol=1e-10,
        stress_atol=1e-12,
    ),
    torch.float32: Tolerances(
        fd_step=1e-3,
        fd_strain=1e-4,
        fd_force_atol=1e-3,
        fd_stress_atol=1e-5,
        fd_rtol=1e-3,
        fd_rounding=4.0,
        rtol=1e-5,
        energy_atol=1e-5,
        force_atol=1e-4,
        stress_atol=1e-6,
    ),
}

_VOIGT = ("xx", "yy", "zz", "yz", "xz", "xy")
_AXES = "xyz"
# Rigid translation of the translation check, in units of the structure's
# nearest-neighbour distance: not a lattice vector of any default structure.
_RIGID_SHIFT = np.array([0.37, -0.81, 1.13])
# Lattice translations of the lattice check: -2 .. 2 cells per periodic axis.
_MAX_CELLS = 2
# Rattling of the default structures, in units of the neighbour distance.
_RATTLE = 0.015
# Nearest-neighbour distance / lattice constant of ASE's reference crystals.
_NEIGHBOUR_FACTOR = {
    "fcc": 1 / math.sqrt(2),
    "bcc": math.sqrt(3) / 2,
    "hcp": 1.0,
    "sc": 1.0,
    "diamond": math.sqrt(3) / 4,
}


# -- structures -------------------------------------------------------------------


def neighbour_distance(elements: Iterable[str]) -> float:
    """Mean nearest-neighbour distance of the elements' ASE reference crystals, Å.

    Parameters
    ----------
    elements : iterable of str
        Chemical symbols.

    Returns
    -------
    float
        The mean over ``elements`` of the nearest-neighbour distance of each
        element's crystal in ``ase.data.reference_states`` when that crystal is
        fcc, bcc, hcp, sc or diamond, else twice its covalent radius.
    """
    distances = []
    for symbol in elements:
        number = atomic_numbers[symbol]
        # ASE types the values as object: "symmetry" is a str, "a" a float
        state: dict[str, Any] = reference_states[number] or {}
        factor = _NEIGHBOUR_FACTOR.get(str(state.get("symmetry")))
        if factor is not None and "a" in state:
            distances.append(float(state["a"]) * factor)
        else:
            distances.append(2.0 * float(covalent_radii[number]))
    return float(np.mean(distances))


def default_structures(
    elements: Sequence[str] = ("Ar",),
    *,
    bond_length: float | None = None,
    seed: int = 0,
) -> list[Atoms]:
    """Five small structures of different sizes, cells and periodicity.

    Parameters
    ----------
    elements : sequence of str
        Chemical symbols, spread over the atoms of every structure (the
        1-atom cell gets the first).
    bond_length : float, optional
        Nearest-neighbour distance, Å; default :func:`neighbour_distance` of
        ``elements`` (3.72 Å for argon).
    seed : int
        Seed of the rattling and of the species assignment.

    Returns
    -------
    list of ase.Atoms
        ``[bulk, triclinic, slab, cluster, one_atom]``: a rattled fcc crystal
        of 16 atoms; 8 rattled atoms in a sheared fcc cell with no right
        angle; a rattled 12-atom fcc(111) slab with 5 Å of vacuum on each side
        (pbc T, T, F, cell of rank 3); a rattled 13-atom icosahedral cluster
        without cell or pbc; one atom in a primitive fcc cell (every lattice
        vector shorter than a typical cutoff, so the atom sees its own images).
    """
    elements = _elements(elements)
    d = neighbour_distance(elements) if bond_length is None else float(bond_length)
    a = d * math.sqrt(2)  # fcc lattice constant
    rng = np.random.default_rng(seed)
    crystal = bulk("X", "fcc", a=a, cubic=True).repeat((2, 2, 1))
    triclinic = bulk("X", "fcc", a=a).repeat((2, 2, 2))
    shear = np.array([[1.02, 0.05, -0.03], [0.0, 0.98, 0.04], [0.02, 0.0, 1.01]])
    triclinic.set_cell(triclinic.cell.array @ shear, scale_atoms=True)
    slab = fcc111("X", size=(2, 2, 3), a=a, vacuum=5.0)
    slab.info.clear()  # ASE's adsorbate-site helper, not simulation data
    cluster = Icosahedron("X", noshells=2, latticeconstant=a)
    cluster.set_cell(np.zeros((3, 3)))
    one_atom = bulk("X", "fcc", a=a)
    images = [crystal, triclinic, slab, cluster]
    for atoms in images:
        atoms.symbols = [
            elements[i % len(elements)] for i in rng.permutation(len(atoms))
        ]
        atoms.positions += rng.normal(scale=_RATTLE * d, size=atoms.positions.shape)
    one_atom.symbols = [elements[0]]
    return [*images, one_atom]


def one_atom_structures(
    elements: Sequence[str] = ("Ar",), *, bond_length: float | None = None
) -> list[Atoms]:
    """One-atom structures of each element: periodic, 2D-periodic and isolated.

    Parameters
    ----------
    elements : sequence of str
        Chemical symbols; three structures each.
    bond_length : float, optional
        Nearest-neighbour distance, Å; default :func:`neighbour_distance` of
        each element.

    Returns
    -------
    list of ase.Atoms
        Per element: one atom in a primitive fcc cell (pbc T, T, T); one atom
        on a 2D hexagonal lattice without a third cell vector (pbc T, T, F,
        cell of rank 2); one isolated atom (no cell, no pbc).
    """
    images = []
    for symbol in _elements(elements):
        d = neighbour_distance([symbol]) if bond_length is None else bond_length
        periodic = bulk(symbol, "fcc", a=d * math.sqrt(2))
        layer = Atoms(
            symbol,
            positions=[[0.0, 0.0, 0.0]],
            cell=[[d, 0.0, 0.0], [d / 2, d * math.sqrt(3) / 2, 0.0], [0.0, 0.0, 0.0]],
            pbc=(True, True, False),
        )
        isolated = Atoms(symbol, positions=[[0.0, 0.0, 0.0]])
        images += [periodic, layer, isolated]
    return images


# -- checks -----------------------------------------------------------------------


def check_output_shapes(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
) -> int:
    """Assert ASE's types and shapes: energy float, forces (N, 3), stress (6,).

    Through ``calc.get_*`` and ``calc.calculate_batch``: the energy is a finite
    float (eV) equal to ``free_energy``; forces are a finite float64 array
    (N, 3), eV/Å; stress, for cells of rank 3 when the model outputs it, a
    finite float64 array (6,), eV/Å³; per-atom ``energies``/``charges`` (N,)
    when the model outputs them; and every array returned is a fresh copy
    (overwriting it does not change the next answer).

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.

    Returns
    -------
    int
        Number of structures checked.

    Raises
    ------
    AssertionError
        Naming the structure index and the property.
    """
    model = resolve_model(model)
    images = _images(structures)
    calc = _calculator(model, dtype, device)
    properties = _properties(calc)
    batched = calc.calculate_batch([a.copy() for a in images], properties)
    for index, atoms in enumerate(images):
        label = _label(index, atoms)
        single = _single_results(calc, atoms, properties)
        for source, results in (
            ("calc.get_*", single),
            ("calculate_batch", batched[index]),
        ):
            _assert_result_types(results, atoms, properties, f"{label} [{source}]")
        work = atoms.copy()
        forces = calc.get_forces(work)
        forces[:] = np.nan
        if not np.isfinite(calc.get_forces(work)).all():
            raise AssertionError(f"{label}: forces returned are not a fresh copy")
    return len(images)


def check_forces_match_finite_differences(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    atoms_per_structure: int = 3,
    tolerances: Tolerances | None = None,
) -> int:
    """Assert forces equal central differences of the energy.

    ASE's ``calculate_numerical_forces`` displaces a spread of atoms by
    ``±fd_step`` along x, y and z (6 single-structure evaluations per atom).

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    atoms_per_structure : int
        How many atoms of each structure are displaced (evenly spread, first
        and last included).
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``; uses ``fd_step``, ``fd_force_atol``,
        ``fd_rtol`` and ``fd_rounding``.

    Returns
    -------
    int
        Number of structures checked.

    Raises
    ------
    AssertionError
        Naming the structure index, atom, component and largest deviation, eV/Å.
    """
    model = resolve_model(model)
    images = _images(structures)
    for index, atoms in enumerate(images):
        calc = _calculator(model, dtype, device)
        tol = _tolerances(calc, tolerances)
        chosen = _spread(len(atoms), atoms_per_structure)
        work = _bare_copy(atoms)
        work.calc = calc
        analytic = work.get_forces()[chosen]
        energy = work.get_potential_energy()
        numerical = calculate_numerical_forces(work, eps=tol.fd_step, iatoms=chosen)
        rounding = tol.fd_rounding * _eps(calc) * abs(energy) / tol.fd_step
        _assert_close(
            analytic,
            numerical,
            atol=tol.fd_force_atol + rounding,
            rtol=tol.fd_rtol,
            label=f"{_label(index, atoms)}: forces vs finite differences "
            f"(step {tol.fd_step:g} Å, {_dtype_name(calc)})",
            unit="eV/Å",
            where=functools.partial(_atom_component, atoms=chosen),
        )
    return len(images)


def check_stress_matches_finite_differences(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    tolerances: Tolerances | None = None,
) -> int:
    """Assert stress equals the strain derivative of the energy, per volume.

    ASE's ``calculate_numerical_stress`` strains the cell (atoms scaled with
    it) by ``±fd_strain`` in each of the six Voigt components (12
    evaluations). Structures whose cell has rank < 3 are left out (no stress).

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``; uses ``fd_strain``, ``fd_stress_atol``,
        ``fd_rtol`` and ``fd_rounding``.

    Returns
    -------
    int
        Number of structures checked (those with a cell of rank 3).

    Raises
    ------
    ValueError
        If the model does not output stress.
    AssertionError
        Naming the structure index, Voigt component and largest deviation,
        eV/Å³.
    """
    model = resolve_model(model)
    _require_stress(model)
    checked = 0
    for index, atoms in enumerate(_images(structures)):
        if atoms.cell.rank < 3:
            continue
        calc = _calculator(model, dtype, device)
        tol = _tolerances(calc, tolerances)
        analytic = _calculator(model, dtype, device).get_stress(_bare_copy(atoms))
        work = _bare_copy(atoms)
        work.calc = calc
        energy = work.get_potential_energy()
        numerical = calculate_numerical_stress(work, eps=tol.fd_strain)
        rounding = (
            tol.fd_rounding
            * _eps(calc)
            * abs(energy)
            / (tol.fd_strain * atoms.get_volume())
        )
        _assert_close(
            analytic,
            numerical,
            atol=tol.fd_stress_atol + rounding,
            rtol=tol.fd_rtol,
            label=f"{_label(index, atoms)}: stress vs finite differences "
            f"(strain {tol.fd_strain:g}, {_dtype_name(calc)})",
            unit="eV/Å³",
            where=_voigt_component,
        )
        checked += 1
    return checked


def check_batch_matches_single(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    tolerances: Tolerances | None = None,
) -> int:
    """Assert one batched evaluation equals evaluating each structure alone.

    ``calc.calculate_batch(structures, ...)`` (one model call for all) against
    ``calc.get_potential_energy(atoms)``, ``get_forces``, ``get_stress`` per
    structure (another calculator): energies, forces and, where defined,
    stress, and the same set of properties.

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures` (1 to 16 atoms, mixed periodicity).
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``; uses ``rtol`` and the ``*_atol``.

    Returns
    -------
    int
        Number of structures checked.

    Raises
    ------
    AssertionError
        Naming the structure index, the property and the largest deviation.
    """
    model = resolve_model(model)
    images = _images(structures)
    batch_calc = _calculator(model, dtype, device)
    single_calc = _calculator(model, dtype, device)
    tol = _tolerances(batch_calc, tolerances)
    properties = _properties(batch_calc)
    batched = batch_calc.calculate_batch([a.copy() for a in images], properties)
    for index, (atoms, result) in enumerate(zip(images, batched, strict=True)):
        single = _single_results(single_calc, atoms, properties)
        _assert_same_results(
            result, single, atoms, tol, f"{_label(index, atoms)}: batched vs single"
        )
    return len(images)


def check_translation_invariance(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    tolerances: Tolerances | None = None,
) -> int:
    """Assert a rigid translation changes nothing and the net force is zero.

    Every structure is moved as a whole by a vector that is not a lattice
    vector; energy, forces and stress must not change, and the forces must
    sum to zero (within ``force_atol + rtol * sum_i |F_i|``).

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``; uses ``rtol`` and the ``*_atol``.

    Returns
    -------
    int
        Number of structures checked.

    Raises
    ------
    AssertionError
        Naming the structure index, the property and the largest deviation.
    """
    model = resolve_model(model)
    images = _images(structures)
    calc = _calculator(model, dtype, device)
    tol = _tolerances(calc, tolerances)
    properties = _properties(calc)
    for index, atoms in enumerate(images):
        label = _label(index, atoms)
        reference = _single_results(calc, atoms, properties)
        moved = atoms.copy()
        moved.positions += _RIGID_SHIFT * _typical_distance(atoms)
        _assert_same_results(
            _single_results(calc, moved, properties),
            reference,
            atoms,
            tol,
            f"{label}: rigidly translated vs not",
        )
        forces = reference["forces"]
        _assert_close(
            forces.sum(axis=0),
            np.zeros(3),
            atol=tol.force_atol
            + tol.rtol * float(np.linalg.norm(forces, axis=1).sum()),
            rtol=0.0,
            label=f"{label}: net force (sum of forces)",
            unit="eV/Å",
            where=lambda flat: f"component {_AXES[flat]}",
        )
    return len(images)


def check_lattice_invariance(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    tolerances: Tolerances | None = None,
) -> int:
    """Assert lattice translations of atoms, and wrapping, change nothing.

    For every structure with a periodic axis: each atom is moved by its own
    random lattice vector (-2 to 2 cells along each periodic axis), and that
    structure is then wrapped back into the cell (``atoms.wrap()``). Energy,
    forces and stress of both must equal the original's.

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`; non-periodic ones are left out.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    seed : int
        Seed of the lattice translations.
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``; uses ``rtol`` and the ``*_atol``.

    Returns
    -------
    int
        Number of (periodic) structures checked.

    Raises
    ------
    AssertionError
        Naming the structure index, the variant, the property and the largest
        deviation.
    """
    model = resolve_model(model)
    calc = _calculator(model, dtype, device)
    tol = _tolerances(calc, tolerances)
    properties = _properties(calc)
    rng = np.random.default_rng(seed)
    checked = 0
    for index, atoms in enumerate(_images(structures)):
        if not atoms.pbc.any():
            continue
        label = _label(index, atoms)
        reference = _single_results(calc, atoms, properties)
        cells = rng.integers(-_MAX_CELLS, _MAX_CELLS + 1, size=(len(atoms), 3))
        shifted = atoms.copy()
        shifted.positions += (cells * atoms.pbc) @ atoms.cell.array
        wrapped = shifted.copy()
        wrapped.wrap()
        for name, variant in (("lattice-translated", shifted), ("wrapped", wrapped)):
            _assert_same_results(
                _single_results(calc, variant, properties),
                reference,
                atoms,
                tol,
                f"{label}: {name} vs original",
            )
        checked += 1
    return checked


def check_one_atom_cells(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    translation_invariant: bool = True,
    tolerances: Tolerances | None = None,
) -> int:
    """Assert one-atom structures evaluate: finite energy, zero force.

    On the 1-atom structures among ``structures`` and on
    :func:`one_atom_structures` of every species in ``structures`` (per
    element: a 1-atom periodic cell, a 1-atom 2D lattice without a third
    vector, an isolated atom), each alone: the model must not fail; the energy
    is a finite float; the force has shape (1, 3) and is finite, and zero
    (within ``force_atol``) when the model is translation invariant (the net
    force of any structure is then zero, and a 1-atom structure's net force is
    its atom's); stress, for cells of rank 3 when the model outputs it, is a
    finite (6,) array.

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Where the species come from; default :func:`default_structures`
        (argon).
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    translation_invariant : bool
        Whether to require a zero force.
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``; uses ``force_atol``.

    Returns
    -------
    int
        Number of structures checked.

    Raises
    ------
    AssertionError
        Naming the structure (index in the checked list, formula, pbc) and the
        property; an exception raised by the model is chained.
    """
    model = resolve_model(model)
    given = _images(structures)
    images = [a for a in given if len(a) == 1] + one_atom_structures(_species(given))
    calc = _calculator(model, dtype, device)
    tol = _tolerances(calc, tolerances)
    properties = _properties(calc)
    for index, atoms in enumerate(images):
        label = f"one-atom {_label(index, atoms)}"
        try:
            results = _single_results(calc, atoms, properties)
        except Exception as error:
            raise AssertionError(
                f"{label}: evaluation raised {type(error).__name__}: {error}"
            ) from error
        _assert_result_types(results, atoms, properties, label)
        if translation_invariant:
            _assert_close(
                results["forces"],
                np.zeros((1, 3)),
                atol=tol.force_atol,
                rtol=0.0,
                label=f"{label}: force on the only atom (must be zero)",
                unit="eV/Å",
                where=lambda flat: f"component {_AXES[flat]}",
            )
    return len(images)


def check_stress_only_for_full_cells(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
) -> int:
    """Assert stress exists exactly for cells of rank 3 (ASE's rule).

    ``NVAlchemiCalculator.get_stress`` must give a (6,) array for a cell of
    rank 3 and raise ``PropertyNotImplementedError`` for a molecule or a slab
    without a third vector; ``calculate_batch`` must include ``stress``
    exactly for the former. Besides the given structures, each one with a
    rank-3 cell and a non-periodic axis is also checked with that axis's cell
    vector removed, and each one with a rank < 3 cell also in a box
    (``atoms.center(vacuum=5.0)`` on its missing axes, pbc unchanged). For a
    model without stress output every ``get_stress`` must raise.

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.

    Returns
    -------
    int
        Number of structures checked, variants included.

    Raises
    ------
    AssertionError
        Naming the structure (index and variant) and what was wrong.
    """
    model = resolve_model(model)
    calc = _calculator(model, dtype, device)
    has_stress = "stress" in calc.implemented_properties
    cases = [
        (f"{_label(index, atoms)}{suffix}", variant)
        for index, atoms in enumerate(_images(structures))
        for suffix, variant in _cell_variants(atoms)
    ]
    batched = (
        calc.calculate_batch([v for _, v in cases], ["energy", "forces", "stress"])
        if has_stress
        else [{} for _ in cases]
    )
    for (label, atoms), result in zip(cases, batched, strict=True):
        full = atoms.cell.rank == 3
        _check_stress_presence(calc, atoms, full and has_stress, label)
        if has_stress and ("stress" in result) != full:
            raise AssertionError(
                f"{label}: calculate_batch {'omitted' if full else 'returned'} stress "
                f"for a cell of rank {atoms.cell.rank}"
            )
    return len(cases)


def check_no_input_mutation(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
) -> int:
    """Assert evaluating leaves the user's ``Atoms`` bit-for-bit unchanged.

    Positions, numbers, cell, pbc, every array (values, dtype, shape), info,
    constraints and the attached calculator (the same object, with the same
    results) are compared before and after ``calc.calculate_batch``,
    ``calc.get_*(atoms)`` and ``atoms.get_*()`` with the calculator attached
    (where the calculator itself is expected to change). Each structure is
    checked as given and as a copy carrying extras: momenta, masses, tags, a
    custom array, info entries, ``FixAtoms`` and a ``SinglePointCalculator``.

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`.
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default :func:`default_structures`. They are not modified by this
        check either (the attached-calculator path runs on copies).
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.

    Returns
    -------
    int
        Number of structures checked (extras-carrying copies included).

    Raises
    ------
    AssertionError
        Naming the structure index and what changed.
    """
    model = resolve_model(model)
    given = _images(structures)
    images = [*given, *(_with_extras(atoms, seed) for seed, atoms in enumerate(given))]
    labels = [
        _label(i % len(given), a) + (" with extras" if i >= len(given) else "")
        for i, a in enumerate(images)
    ]
    calc = _calculator(model, dtype, device)
    properties = _properties(calc)
    before = [_snapshot(atoms) for atoms in images]
    calc.calculate_batch(images, properties)
    for label, atoms, snap in zip(labels, images, before, strict=True):
        _assert_unchanged(snap, atoms, f"{label} after calculate_batch")
    for label, atoms, snap in zip(labels, images, before, strict=True):
        _single_results(calc, atoms, properties, copy=False)
        _assert_unchanged(snap, atoms, f"{label} after calc.get_*(atoms)")
    for label, atoms in zip(labels, images, strict=True):
        attached = atoms.copy()
        attached.calc = _calculator(model, dtype, device)
        snap = _snapshot(attached)
        attached.get_potential_energy()
        attached.get_forces()
        if "stress" in properties and attached.cell.rank == 3:
            attached.get_stress()
        _assert_unchanged(
            snap, attached, f"{label} after atoms.get_*()", calc_may_change=True
        )
    return len(images)


#: Every check by its name in :func:`check_model` (``skip=``), in running order.
CHECKS: dict[str, Callable[..., int]] = {
    "outputs": check_output_shapes,
    "forces": check_forces_match_finite_differences,
    "stress": check_stress_matches_finite_differences,
    "batch": check_batch_matches_single,
    "translation": check_translation_invariance,
    "lattice": check_lattice_invariance,
    "one_atom": check_one_atom_cells,
    "stress_rank": check_stress_only_for_full_cells,
    "mutation": check_no_input_mutation,
}


def check_model(
    model: BaseModelMixin | str,
    structures: Structures = None,
    *,
    elements: Sequence[str] | None = None,
    dtype: DtypeLike = None,
    device: str | torch.device = "cpu",
    periodic: bool | None = None,
    translation_invariant: bool = True,
    skip: Collection[str] = (),
    atoms_per_structure: int = 3,
    tolerances: Tolerances | None = None,
) -> dict[str, str]:
    """Run every check of :data:`CHECKS` that applies; raise once for all failures.

    Parameters
    ----------
    model : BaseModelMixin or str
        The model, or a name for :func:`nvalchemi_ase.models.load_model`
        (loaded once for all checks).
    structures : ase.Atoms or sequence of ase.Atoms, optional
        Default ``default_structures(elements)``.
    elements : sequence of str, optional
        Species of the default structures (``structures=None`` only); default
        argon. The one-atom check uses the species of the structures.
    dtype : torch.dtype or str, optional
        Precision of the evaluation; default the calculator's (the model's).
    device : torch.device or str
        Where the model runs.
    periodic : bool, optional
        Whether the model handles periodic boundaries (lattice check); default
        the model's ``model_config.supports_pbc``.
    translation_invariant : bool
        Whether the model's energy is invariant under rigid translations
        (translation check, zero force of one-atom structures). nvalchemi's
        demo model is not.
    skip : collection of str
        Names of checks (keys of :data:`CHECKS`) not to run.
    atoms_per_structure : int
        Atoms displaced per structure by the finite-difference force check.
    tolerances : Tolerances, optional
        Default ``TOLERANCES[dtype]``.

    Returns
    -------
    dict of str to str
        For each check name, ``"passed (n structures)"`` or ``"skipped: why"``.

    Raises
    ------
    AssertionError
        Listing every failed check with its message (structure index,
        property, largest deviation).
    ValueError
        For an unknown name in ``skip``, or both ``structures`` and ``elements``.
    """
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {sorted(CHECKS)}")
    if structures is not None and elements is not None:
        raise ValueError(
            "give structures or elements (the species of the default structures), "
            "not both"
        )
    model = resolve_model(model)
    images = (
        default_structures(elements or ("Ar",))
        if structures is None
        else _images(structures)
    )
    periodic = bool(model.model_config.supports_pbc) if periodic is None else periodic
    reasons = _skip_reasons(model, skip, periodic, translation_invariant)
    common: dict[str, Any] = {"dtype": dtype, "device": device}
    report: dict[str, str] = {}
    failures: list[str] = []
    for name, check in CHECKS.items():
        if name in reasons:
            report[name] = f"skipped: {reasons[name]}"
            continue
        kwargs = dict(common)
        if "tolerances" in _parameters(check):
            kwargs["tolerances"] = tolerances
        if name == "one_atom":
            kwargs["translation_invariant"] = translation_invariant
        if name == "forces":
            kwargs["atoms_per_structure"] = atoms_per_structure
        count = _run(check, failures, name, model, images, **kwargs)
        report[name] = "failed" if count is None else f"passed ({count} structures)"
    if failures:
        ran = len(CHECKS) - len(reasons)
        raise AssertionError(
            f"{len(failures)} of {ran} checks failed for "
            f"{type(model).__name__}:\n" + "\n".join(failures)
        )
    return report


# -- helpers: running ---------------------------------------------------------------


def _run(
    check: Callable[..., int], failures: list[str], name: str, *args: Any, **kwargs: Any
) -> int | None:
    try:
        return check(*args, **kwargs)
    except AssertionError as error:
        failures.append(f"[{name}] {error}")
        return None


def _parameters(function: Callable[..., Any]) -> Collection[str]:
    return inspect.signature(function).parameters


def _skip_reasons(
    model: BaseModelMixin, skip: Collection[str], periodic: bool, invariant: bool
) -> dict[str, str]:
    reasons = dict.fromkeys(skip, "skip=")
    if "stress" not in model.model_config.outputs:
        reasons.setdefault("stress", "the model has no stress output")
    if not periodic:
        reasons.setdefault("lattice", "periodic=False")
    if not invariant:
        reasons.setdefault("translation", "translation_invariant=False")
    return reasons


def _calculator(
    model: BaseModelMixin, dtype: DtypeLike, device: str | torch.device
) -> NVAlchemiCalculator:
    return NVAlchemiCalculator(model, device=device, dtype=dtype)


def _tolerances(calc: NVAlchemiCalculator, tolerances: Tolerances | None) -> Tolerances:
    return TOLERANCES[calc.dtype] if tolerances is None else tolerances


def _eps(calc: NVAlchemiCalculator) -> float:
    return float(torch.finfo(calc.dtype).eps)


def _dtype_name(calc: NVAlchemiCalculator) -> str:
    return str(calc.dtype).removeprefix("torch.")


def _properties(calc: NVAlchemiCalculator) -> list[str]:
    return [
        p for p in ("energy", "forces", "stress") if p in calc.implemented_properties
    ]


def _require_stress(model: BaseModelMixin) -> None:
    if "stress" not in model.model_config.outputs:
        raise ValueError(
            f"{type(model).__name__} does not output stress "
            f"(model_config.outputs = {sorted(model.model_config.outputs)})"
        )


def _single_results(
    calc: NVAlchemiCalculator,
    atoms: Atoms,
    properties: Sequence[str],
    *,
    copy: bool = True,
) -> dict[str, Any]:
    """ASE's single-structure path, ``calc.get_*(atoms)``, on a copy by default."""
    atoms = atoms.copy() if copy else atoms
    results: dict[str, Any] = {
        "energy": calc.get_potential_energy(atoms),
        "forces": calc.get_forces(atoms),
    }
    if "stress" in properties and atoms.cell.rank == 3:
        results["stress"] = calc.get_stress(atoms)
    return results


# -- helpers: structures ------------------------------------------------------------


def _images(structures: Structures) -> list[Atoms]:
    return default_structures() if structures is None else as_atoms_list(structures)


def _elements(elements: Sequence[str]) -> list[str]:
    if isinstance(elements, str):
        elements = [elements]
    elements = list(elements)
    if not elements:
        raise ValueError("elements must name at least one chemical symbol")
    unknown = [s for s in elements if s not in atomic_numbers]
    if unknown:
        raise ValueError(f"unknown chemical symbols {unknown}")
    return elements


def _species(images: Sequence[Atoms]) -> list[str]:
    return sorted(
        {symbol for atoms in images for symbol in atoms.get_chemical_symbols()}
    )


def _typical_distance(atoms: Atoms) -> float:
    return neighbour_distance(sorted(set(atoms.get_chemical_symbols())))


def _spread(n_atoms: int, count: int) -> list[int]:
    if count < 1:
        raise ValueError(f"atoms_per_structure must be at least 1, got {count}")
    return sorted({int(i) for i in np.linspace(0, n_atoms - 1, min(count, n_atoms))})


def _bare_copy(atoms: Atoms) -> Atoms:
    """Copy ``atoms`` without its constraints (they would zero or project forces)."""
    copy = atoms.copy()
    copy.set_constraint()
    return copy


def _cell_variants(atoms: Atoms) -> list[tuple[str, Atoms]]:
    variants = [("", atoms.copy())]
    open_axes = [axis for axis in range(3) if not atoms.pbc[axis]]
    missing = [axis for axis in range(3) if not atoms.cell.array[axis].any()]
    if atoms.cell.rank == 3 and open_axes:
        cut = atoms.copy()
        cell = cut.cell.array.copy()
        cell[open_axes] = 0.0
        cut.set_cell(cell)
        variants.append((" without the cell vectors of its non-periodic axes", cut))
    elif missing:
        boxed = atoms.copy()
        boxed.center(vacuum=5.0, axis=tuple(missing))
        variants.append((" centred in a box", boxed))
    return variants


def _with_extras(atoms: Atoms, seed: int) -> Atoms:
    """Copy ``atoms`` with extras that the calculator must not touch."""
    rng = np.random.default_rng(seed)
    extra = atoms.copy()
    n_atoms = len(extra)
    extra.set_momenta(rng.normal(size=(n_atoms, 3)))
    extra.set_masses(extra.get_masses() * 1.5)
    extra.set_tags(np.arange(n_atoms))
    extra.new_array("user_array", rng.normal(size=(n_atoms, 2)))
    extra.info.update({"label": "kept", "values": np.arange(3.0), "nested": {"k": [1]}})
    extra.set_constraint(FixAtoms(indices=[0]))
    extra.calc = SinglePointCalculator(extra, energy=1.0, forces=np.ones((n_atoms, 3)))
    return extra


# -- helpers: comparing -------------------------------------------------------------


def _label(index: int, atoms: Atoms) -> str:
    pbc = "".join("T" if p else "F" for p in atoms.pbc)
    return (
        f"structures[{index}] ({atoms.get_chemical_formula()}, {len(atoms)} atoms, "
        f"pbc {pbc}, cell rank {atoms.cell.rank})"
    )


def _atom_component(flat: int, atoms: Sequence[int]) -> str:
    row, column = divmod(flat, 3)
    return f"atom {atoms[row]}, component {_AXES[column]}"


def _voigt_component(flat: int) -> str:
    return f"component {_VOIGT[flat]}"


def _assert_close(
    actual: Any,
    expected: Any,
    *,
    atol: float,
    rtol: float,
    label: str,
    unit: str,
    where: Callable[[int], str] | None = None,
) -> None:
    """Raise unless ``max|actual - expected| <= atol + rtol * max|expected|``."""
    actual = np.asarray(actual, dtype=float)
    expected = np.asarray(expected, dtype=float)
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{label}: shape {actual.shape}, expected {expected.shape}"
        )
    if not np.isfinite(actual).all():
        raise AssertionError(f"{label}: not finite: {actual.tolist()}")
    deviation = np.abs(actual - expected).reshape(-1)
    if not deviation.size:
        return
    allowed = atol + rtol * float(np.abs(expected).max())
    worst = int(np.argmax(deviation))
    if deviation[worst] <= allowed:
        return
    location = f" at {where(worst)}" if where is not None else ""
    raise AssertionError(
        f"{label}: largest deviation {deviation[worst]:.3g} {unit}{location} "
        f"(got {actual.reshape(-1)[worst]:.10g}, expected "
        f"{expected.reshape(-1)[worst]:.10g}; allowed {allowed:.3g} {unit} = "
        f"{atol:.3g} + {rtol:.3g} x max|expected| {np.abs(expected).max():.3g})"
    )


def _assert_same_results(
    actual: dict[str, Any],
    expected: dict[str, Any],
    atoms: Atoms,
    tol: Tolerances,
    label: str,
) -> None:
    compared = ("energy", "forces", "stress")
    have = sorted(k for k in compared if k in actual)
    want = sorted(k for k in compared if k in expected)
    if have != want:
        raise AssertionError(f"{label}: properties {have}, expected {want}")
    _assert_close(
        actual["energy"],
        expected["energy"],
        atol=tol.energy_atol * len(atoms),
        rtol=tol.rtol,
        label=f"{label}: energy",
        unit="eV",
    )
    _assert_close(
        actual["forces"],
        expected["forces"],
        atol=tol.force_atol,
        rtol=tol.rtol,
        label=f"{label}: forces",
        unit="eV/Å",
        where=lambda flat: _atom_component(flat, range(len(atoms))),
    )
    if "stress" in expected:
        _assert_close(
            actual["stress"],
            expected["stress"],
            atol=tol.stress_atol,
            rtol=tol.rtol,
            label=f"{label}: stress",
            unit="eV/Å³",
            where=_voigt_component,
        )


def _assert_result_types(
    results: dict[str, Any], atoms: Atoms, properties: Sequence[str], label: str
) -> None:
    energy = results.get("energy")
    if not isinstance(energy, float) or not math.isfinite(energy):
        raise AssertionError(f"{label}: energy must be a finite float, got {energy!r}")
    if "free_energy" in results and results["free_energy"] != energy:
        raise AssertionError(f"{label}: free_energy {results['free_energy']} != energy")
    shapes = {"forces": (len(atoms), 3), "energies": (len(atoms),)}
    shapes["charges"] = (len(atoms),)
    if "stress" in properties and atoms.cell.rank == 3:
        shapes["stress"] = (6,)
    elif "stress" in results:
        raise AssertionError(f"{label}: stress for a cell of rank {atoms.cell.rank}")
    for key, shape in shapes.items():
        if key not in results and key in ("energies", "charges"):
            continue
        value = results.get(key)
        if (
            not isinstance(value, np.ndarray)
            or value.shape != shape
            or value.dtype != np.float64
            or not np.isfinite(value).all()
        ):
            described = (
                f"{type(value).__name__} {getattr(value, 'dtype', '')} "
                f"{getattr(value, 'shape', '')}"
            )
            raise AssertionError(
                f"{label}: {key} must be a finite float64 numpy array of shape "
                f"{shape}, got {described}"
            )


def _check_stress_presence(
    calc: NVAlchemiCalculator, atoms: Atoms, expected: bool, label: str
) -> None:
    rank = atoms.cell.rank
    try:
        stress = calc.get_stress(atoms.copy())
    except PropertyNotImplementedError:
        if expected:
            raise AssertionError(
                f"{label}: get_stress raised PropertyNotImplementedError for a cell "
                "of rank 3"
            ) from None
        return
    if not expected:
        raise AssertionError(
            f"{label}: get_stress returned {np.asarray(stress).tolist()} instead of "
            f"raising PropertyNotImplementedError (cell of rank {rank})"
        )
    stress = np.asarray(stress)
    if stress.shape != (6,) or not np.isfinite(stress).all():
        raise AssertionError(
            f"{label}: stress must be finite of shape (6,), got {stress.tolist()}"
        )


# -- helpers: snapshots -------------------------------------------------------------


def _snapshot(atoms: Atoms) -> dict[str, Any]:
    calc = atoms.calc
    return {
        "arrays": {
            key: (value.dtype.str, value.shape, value.tobytes())
            for key, value in atoms.arrays.items()
        },
        "cell": atoms.cell.array.tobytes(),
        "pbc": atoms.pbc.tobytes(),
        "celldisp": np.asarray(atoms.get_celldisp()).tobytes(),
        "info": _frozen(atoms.info),
        "constraints": _frozen([c.todict() for c in atoms.constraints]),
        "calc": calc,
        "calc_results": _frozen(getattr(calc, "results", None)),
    }


def _frozen(value: Any) -> Any:
    """Return a comparable, bit-exact image of nested containers and arrays."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, float):
        return ("float", np.float64(value).tobytes())
    return ("other", repr(value))


def _assert_unchanged(
    before: dict[str, Any], atoms: Atoms, label: str, *, calc_may_change: bool = False
) -> None:
    after = _snapshot(atoms)
    changed = [
        key
        for key in before
        if not (calc_may_change and key.startswith("calc"))
        and (
            before[key] is not after[key]
            if key == "calc"
            else before[key] != after[key]
        )
    ]
    if "arrays" in changed:
        old, new = before["arrays"], after["arrays"]
        changed.remove("arrays")
        changed += [
            f"arrays[{key!r}]"
            for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)
        ]
    if changed:
        raise AssertionError(f"{label}: the user's Atoms changed: {', '.join(changed)}")
