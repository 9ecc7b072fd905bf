"""NVAlchemiCalculator against finite differences, ASE's own LJ and ASE optimizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.calculators.calculator import PropertyNotImplementedError, compare_atoms
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress
from ase.calculators.lj import LennardJones
from ase.neighborlist import neighbor_list
from ase.optimize import BFGS, FIRE

from nvalchemi_ase import NVAlchemiCalculator, StructureError
from nvalchemi_ase.models.builtin import ARGON
from tests._tolerances import (
    BATCH_VS_SINGLE_RTOL,
    EXACT,
    FD_FORCE_ATOL,
    FD_STEP,
    FD_STRAIN,
    FD_STRESS_ATOL,
)
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import CATALOGUE, cluster, rattled_bulk, slab

FULL_CELL = {"bulk", "triclinic", "one_atom", "small_cell", "left_handed"}


def ase_lj(atoms):
    calc = LennardJones(
        epsilon=ARGON["epsilon"],
        sigma=ARGON["sigma"],
        rc=ARGON["cutoff"],
        ro=ARGON["cutoff"],
        smooth=False,
    )
    copy = atoms.copy()
    copy.calc = calc
    return copy


def cutoff_shift(atoms) -> float:
    """ASE's LJ energy minus nvalchemi's: ASE shifts each pair by -u(rc)."""
    ratio = ARGON["sigma"] / ARGON["cutoff"]
    u_rc = 4 * ARGON["epsilon"] * (ratio**12 - ratio**6)
    n_pairs = len(neighbor_list("i", atoms, ARGON["cutoff"])) // 2
    return -n_pairs * u_rc


# the 108-atom crystal and the 55-atom cluster (72 and 66 model calls) run in the
# full suite; the slab, left-handed and small cells keep the check in the fast one
FD_FORCES_SLOW = {"bulk", "cluster"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in FD_FORCES_SLOW else name
        for name in sorted(CATALOGUE)
    ],
)
def test_forces_match_finite_differences(name, lj_calc64):
    atoms = CATALOGUE[name]()
    atoms.calc = lj_calc64
    checked = np.arange(0, len(atoms), max(1, len(atoms) // 12))  # a spread of atoms
    numerical = calculate_numerical_forces(atoms, eps=FD_STEP, iatoms=checked)
    np.testing.assert_allclose(
        atoms.get_forces()[checked],
        numerical,
        rtol=0,
        atol=FD_FORCE_ATOL[torch.float64],
    )


@pytest.mark.parametrize("name", sorted(FULL_CELL))
def test_stress_matches_finite_differences(name, lj_calc64):
    atoms = CATALOGUE[name]()
    atoms.calc = lj_calc64
    numerical = calculate_numerical_stress(atoms, eps=FD_STRAIN)
    np.testing.assert_allclose(
        atoms.get_stress(), numerical, rtol=0, atol=FD_STRESS_ATOL[torch.float64]
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_golden_reference_ase_lennard_jones(name, dtype, calc_by_dtype):
    atoms = CATALOGUE[name]()
    reference = ase_lj(atoms)
    atoms.calc = calc_by_dtype[dtype]
    tol = EXACT[dtype]
    scale = max(1.0, np.abs(reference.get_forces()).max())
    np.testing.assert_allclose(
        atoms.get_forces(), reference.get_forces(), rtol=0, atol=tol * scale
    )
    expected_energy = reference.get_potential_energy() - cutoff_shift(atoms)
    assert atoms.get_potential_energy() == pytest.approx(
        expected_energy, rel=tol, abs=tol * len(atoms)
    )
    if name in FULL_CELL:
        np.testing.assert_allclose(
            atoms.get_stress(), reference.get_stress(), rtol=0, atol=tol * 1e-2
        )


@pytest.mark.parametrize(
    "optimizer", [pytest.param(BFGS, marks=pytest.mark.slow), FIRE]
)
def test_ase_optimizers_reach_the_same_minimum_as_with_ase_lj(optimizer, lj_calc64):
    atoms = cluster()
    atoms.rattle(0.1, seed=11)
    reference = ase_lj(atoms)
    atoms.calc = lj_calc64
    steps_ours = _relax(optimizer, atoms)
    steps_ref = _relax(optimizer, reference)
    assert steps_ours == steps_ref
    np.testing.assert_allclose(atoms.positions, reference.positions, rtol=0, atol=1e-6)
    assert np.linalg.norm(atoms.get_forces(), axis=1).max() < 1e-3


def _relax(optimizer, atoms) -> int:
    opt = optimizer(atoms, logfile=None)
    assert opt.run(fmax=1e-3, steps=500)
    return opt.get_number_of_steps()


def test_calculate_batch_equals_one_by_one_and_changes_nothing(lj_calc64):
    images = [CATALOGUE[name]() for name in sorted(CATALOGUE)]
    before = [snapshot(a) for a in images]
    batched = lj_calc64.calculate_batch(
        images, properties=["energy", "forces", "stress"]
    )
    for atoms, snap in zip(images, before, strict=True):
        assert_same_snapshot(snap, atoms)
    for atoms, result in zip(images, batched, strict=True):
        single = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
        single_results = single.calculate_batch(
            [atoms], ["energy", "forces", "stress"]
        )[0]
        assert result.keys() == single_results.keys()
        assert result["energy"] == pytest.approx(
            single_results["energy"], rel=BATCH_VS_SINGLE_RTOL
        )
        np.testing.assert_allclose(
            result["forces"],
            single_results["forces"],
            rtol=BATCH_VS_SINGLE_RTOL,
            atol=1e-15,
        )
        if "stress" in result:
            np.testing.assert_allclose(
                result["stress"],
                single_results["stress"],
                rtol=BATCH_VS_SINGLE_RTOL,
                atol=1e-18,
            )


def test_properties_are_float64_copies_and_free_energy_equals_energy(lj_calc32):
    atoms = rattled_bulk(repeat=2)
    atoms.calc = lj_calc32
    forces = atoms.get_forces()
    assert forces.dtype == np.float64
    forces[:] = 123.0
    assert not np.any(atoms.get_forces() == 123.0)
    assert (
        atoms.get_potential_energy(force_consistent=True)
        == atoms.get_potential_energy()
    )


def test_results_are_cached_and_info_charge_invalidates(lj_calc64):
    calls = []
    handle = lj_calc64.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        atoms = rattled_bulk(repeat=2)
        atoms.calc = lj_calc64
        atoms.get_potential_energy()
        atoms.get_forces()
        assert len(calls) == 1  # energy and forces come together
        atoms.info["charge"] = 1
        atoms.get_potential_energy()
        assert len(calls) == 2
        atoms.positions[0, 0] += 1e-3
        atoms.get_forces()
        assert len(calls) == 3
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["bulk", "slab", "cluster"])
def test_reused_batch_gives_what_a_fresh_calculator_gives(name, lj_calc64):
    """Moving, straining and re-typing one Atoms between calls (the batch of the
    previous call is refreshed in place) matches a new calculator every time."""
    atoms = CATALOGUE[name]()
    atoms.calc = lj_calc64
    rng = np.random.default_rng(7)

    def check():
        fresh = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype=torch.float64)
        reference = atoms.copy()
        reference.calc = fresh
        assert atoms.get_potential_energy() == pytest.approx(
            reference.get_potential_energy(), rel=BATCH_VS_SINGLE_RTOL, abs=1e-12
        )
        np.testing.assert_allclose(
            atoms.get_forces(), reference.get_forces(), rtol=0, atol=1e-12
        )

    check()
    atoms.positions += rng.normal(scale=0.3, size=atoms.positions.shape)
    check()
    atoms.positions[0] += 4.0  # a molecule's or slab's extent grows
    check()
    if atoms.pbc.all():
        atoms.set_cell(atoms.cell.array * 1.02, scale_atoms=True)
        check()
    atoms.numbers[0] = 36  # krypton: the model's inputs changed, a new batch
    check()


def test_check_state_agrees_with_ases_compare_atoms(lj_calc64):
    atoms = rattled_bulk(repeat=2)
    atoms.calc = lj_calc64
    atoms.get_potential_energy()
    edits = {
        "nothing": lambda a: None,
        "momenta": lambda a: a.set_momenta(np.ones((len(a), 3))),
        "position by one ulp": lambda a: a.positions.__setitem__(
            (0, 0), np.nextafter(a.positions[0, 0], np.inf)
        ),
        "position": lambda a: a.positions.__setitem__((0, 0), 1.0),
        "cell": lambda a: a.set_cell(a.cell.array * 1.01),
        "pbc": lambda a: a.set_pbc([True, True, False]),
        "charges": lambda a: a.set_initial_charges(np.ones(len(a))),
        "numbers": lambda a: a.numbers.__setitem__(0, 36),
    }
    for name, edit in edits.items():
        edited = atoms.copy()
        edit(edited)
        assert sorted(lj_calc64.check_state(edited)) == sorted(
            compare_atoms(lj_calc64.atoms, edited)
        ), name


def test_stress_of_a_structure_without_full_cell_is_not_implemented(lj_calc64):
    atoms = slab()
    atoms.calc = lj_calc64
    with pytest.raises(PropertyNotImplementedError, match="rank 3"):
        atoms.get_stress()


def test_model_without_stress_raises_property_not_implemented():
    calc = NVAlchemiCalculator("demo", device="cpu")
    atoms = cluster()
    atoms.calc = calc
    assert np.isfinite(atoms.get_potential_energy())
    assert "stress" not in calc.implemented_properties
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stress()
    with pytest.raises(PropertyNotImplementedError, match="DemoModelWrapper"):
        calc.calculate_batch([atoms], properties=["stress"])


def test_lattice_translation_of_an_atom_changes_nothing(lj_calc64):
    atoms = rattled_bulk(repeat=2)
    moved = atoms.copy()
    moved.positions[3] += 2 * atoms.cell[0] - atoms.cell[2]
    first, second = lj_calc64.calculate_batch(
        [atoms, moved], ["energy", "forces", "stress"]
    )
    assert first["energy"] == pytest.approx(second["energy"], rel=1e-12)
    np.testing.assert_allclose(first["forces"], second["forces"], atol=1e-12)
    np.testing.assert_allclose(first["stress"], second["stress"], atol=1e-14)


def test_bad_structure_raises_before_any_model_call_and_mutates_nothing(lj_calc64):
    calls = []
    handle = lj_calc64.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        good, bad = rattled_bulk(repeat=2), rattled_bulk(repeat=2, seed=3)
        bad.positions[7] = np.nan
        before = [snapshot(good), snapshot(bad)]
        with pytest.raises(StructureError, match=r"images\[1\]\.positions\[7\]"):
            lj_calc64.calculate_batch([good, bad])
        assert calls == []
        assert_same_snapshot(before[0], good)
        assert_same_snapshot(before[1], bad)
    finally:
        handle.remove()


def test_unknown_model_and_bad_options_are_clear_errors():
    with pytest.raises(
        ValueError,
        match=r"unknown model 'mace-xl'; known models: 7net-0, .*demo, .*lj, ",
    ):
        NVAlchemiCalculator("mace-xl")
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        NVAlchemiCalculator("lj", dtype="float16")
    with pytest.raises(TypeError, match="must be an nvalchemi BaseModelMixin"):
        NVAlchemiCalculator(object())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            NVAlchemiCalculator("lj", device="cuda")


def test_default_dtype_follows_the_model():
    assert NVAlchemiCalculator("lj", device="cpu").dtype == torch.float64
    assert NVAlchemiCalculator("demo", device="cpu").dtype == torch.float32


@pytest.mark.gpu
def test_cuda_matches_cpu():
    # its own calculators: the session's shared ``lj_calc64`` is never touched
    images = [rattled_bulk(repeat=3), slab(), cluster()]
    cpu = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    gpu = NVAlchemiCalculator(cpu.model, device="cuda", dtype="float64")
    on_gpu = gpu.calculate_batch(images, ["energy", "forces"])
    on_cpu = cpu.calculate_batch(images, ["energy", "forces"])
    for a, b in zip(on_gpu, on_cpu, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], rel=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)


def test_a_model_passed_in_is_never_changed_in_place():
    from nvalchemi_ase.models import load_model

    model = load_model("demo")  # float32 weights on the CPU
    weight = next(model.parameters())
    before = weight.detach().clone()
    calc64 = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    assert weight.dtype == torch.float32
    assert torch.equal(weight, before)
    assert calc64.model is not model
    assert next(calc64.model.parameters()).dtype == torch.float64
    # a model already where the calculator runs is shared, not copied
    calc32 = NVAlchemiCalculator(model, device="cpu", dtype="float32")
    assert calc32.model is model
    atoms = rattled_bulk(repeat=1)
    atoms.calc = calc64
    e64 = atoms.get_potential_energy()
    atoms.calc = calc32
    assert atoms.get_potential_energy() == pytest.approx(e64, rel=1e-5)
