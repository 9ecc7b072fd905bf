"""ASE-style MD against ASE's integrators and statistical mechanics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.constraints import FixAtoms, Hookean
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.dynamics.neighbors import is_neighbor_hook
from nvalchemi_ase.md import (
    IsotropicMTKNPT,
    Langevin,
    NoseHooverChainNVT,
    VelocityVerlet,
)
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import cluster, rattled_bulk, slab, thermalize

VERLET_POSITION_TOL = 1e-10  # Å after 200 steps, float64 (measured ~1e-14: round-off)


@pytest.mark.slow  # 200 batched steps, then 4 x 200 single-structure ASE steps
def test_velocity_verlet_matches_ase_for_each_structure_of_a_batch(lj_calc64):
    images = [
        thermalize(rattled_bulk(repeat=2, seed=1), 60.0, seed=1),
        thermalize(rattled_bulk(repeat=3, seed=2), 40.0, seed=2),
        thermalize(cluster(), 30.0, seed=3),
        thermalize(slab(), 30.0, seed=4),
    ]
    references = [atoms.copy() for atoms in images]
    for atoms in images:
        atoms.calc = lj_calc64
    assert VelocityVerlet(images, 2 * units.fs).run(200)
    for atoms, reference in zip(images, references, strict=True):
        reference.calc = NVAlchemiCalculator(
            lj_calc64.model, device="cpu", dtype="float64"
        )
        AseVelocityVerlet(reference, 2 * units.fs).run(200)
        assert np.abs(atoms.positions - reference.positions).max() < VERLET_POSITION_TOL
        np.testing.assert_allclose(
            atoms.get_momenta(), reference.get_momenta(), atol=1e-8
        )
        assert atoms.get_potential_energy() == pytest.approx(
            reference.get_potential_energy(), abs=1e-9
        )


def test_single_structure_md_log_is_ases(tmp_path, lj_calc64):
    atoms = thermalize(rattled_bulk(repeat=2), 50.0, seed=1)
    reference = atoms.copy()
    atoms.calc = lj_calc64
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    VelocityVerlet(atoms, units.fs, logfile=tmp_path / "ours.log", loginterval=2).run(6)
    AseVelocityVerlet(
        reference, units.fs, logfile=tmp_path / "ase.log", loginterval=2
    ).run(6)
    assert (tmp_path / "ours.log").read_text() == (tmp_path / "ase.log").read_text()


def _mean_temperature_second_half(dyn, steps: int, every: int = 5) -> np.ndarray:
    samples = []
    dyn.attach(lambda: samples.append(dyn.per_structure_thermo()["temperature"]), every)
    dyn.run(steps)
    half = np.array(samples[len(samples) // 2 :])
    return half.mean(axis=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "label"),
    [
        (
            lambda images, T: Langevin(
                images, 4 * units.fs, T, 0.05 / units.fs, seed=7
            ),
            "langevin",
        ),
        (
            lambda images, T: NoseHooverChainNVT(
                images, 4 * units.fs, T, 50 * units.fs
            ),
            "nhc",
        ),
    ],
)
def test_thermostats_reach_per_structure_targets(make, label, lj_calc64):
    """Each structure's mean temperature (second half) is within 3 % of its target."""
    targets = np.array([70.0, 100.0, 130.0, 100.0])
    images = [
        thermalize(rattled_bulk(repeat=3, seed=10 + i), t, seed=20 + i)
        for i, t in enumerate(targets)
    ]
    for atoms in images:
        atoms.calc = lj_calc64
    mean = _mean_temperature_second_half(make(images, targets), steps=2500)
    np.testing.assert_allclose(mean, targets, rtol=0.03)


def test_langevin_is_reproducible_with_a_seed(lj_calc64):
    finals = []
    for _ in range(2):
        atoms = thermalize(rattled_bulk(repeat=2), 50.0, seed=3)
        atoms.calc = lj_calc64
        Langevin(atoms, 2 * units.fs, 50.0, 0.02 / units.fs, seed=123).run(20)
        finals.append(atoms.positions.copy())
    np.testing.assert_array_equal(finals[0], finals[1])


@pytest.mark.slow
def test_npt_at_zero_pressure_has_zero_mean_pressure(smooth_lj):
    atoms = thermalize(rattled_bulk(repeat=3, seed=5), 50.0, seed=5)
    atoms.calc = smooth_lj
    dyn = IsotropicMTKNPT(
        atoms,
        4 * units.fs,
        temperature_K=50.0,
        pressure_au=0.0,
        tdamp=100 * units.fs,
        pdamp=1000 * units.fs,
    )
    pressures = []

    def record():
        stress = atoms.get_stress(include_ideal_gas=True)
        pressures.append(-stress[:3].mean() / units.GPa)

    dyn.attach(record, interval=5)
    dyn.run(2000)
    assert abs(np.mean(pressures[len(pressures) // 2 :])) < 0.05


def test_frozen_atoms_do_not_move_and_temperature_counts_free_atoms(lj_calc64):
    atoms = thermalize(rattled_bulk(repeat=2), 80.0, seed=2)
    fixed = [0, 3, 7]
    atoms.set_constraint(FixAtoms(indices=fixed))
    start = atoms.positions[fixed].copy()
    atoms.calc = lj_calc64
    dyn = VelocityVerlet(atoms, 2 * units.fs)
    dyn.run(30)
    np.testing.assert_array_equal(atoms.positions[fixed], start)
    np.testing.assert_array_equal(atoms.get_momenta()[fixed], 0.0)
    assert dyn.per_structure_thermo()["temperature"][0] == pytest.approx(
        atoms.get_temperature(), rel=1e-10
    )


def test_energy_is_conserved_with_a_smooth_cutoff(smooth_lj):
    atoms = thermalize(rattled_bulk(repeat=3, seed=8), 50.0, seed=8)
    atoms.calc = smooth_lj
    totals = []
    dyn = VelocityVerlet(atoms, 2 * units.fs)
    dyn.attach(lambda: totals.append(atoms.get_total_energy()), interval=10)
    dyn.run(500)
    assert np.ptp(totals) / len(atoms) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timestep": -1.0}, "timestep must be positive"),
        ({"temperature_K": -5.0}, r"temperature_K for images\[0\] is -5.0"),
        ({"temperature_K": [100.0, 200.0, 300.0]}, r"temperature_K has shape \(3,\)"),
        ({"friction": -0.01}, r"friction for images\[0\] is -0.01"),
    ],
)
def test_bad_md_arguments_raise_before_any_step(kwargs, message, lj_calc64):
    images = [rattled_bulk(repeat=2), rattled_bulk(repeat=2, seed=4)]
    for atoms in images:
        atoms.calc = lj_calc64
    before = [snapshot(a) for a in images]
    arguments = {
        "timestep": units.fs,
        "temperature_K": 100.0,
        "friction": 0.01,
    } | kwargs
    with pytest.raises(ValueError, match=message):
        Langevin(images, **arguments)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_unsupported_constraint_is_named_before_any_step(lj_calc64):
    images = [rattled_bulk(repeat=2), cluster()]
    images[1].set_constraint(Hookean(0, 1, k=1.0, rt=4.0))
    for atoms in images:
        atoms.calc = lj_calc64
    before = [snapshot(a) for a in images]
    with pytest.raises(ValueError, match=r"images\[1\] has constraint Hookean"):
        VelocityVerlet(images, units.fs)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_npt_refuses_non_periodic_structures(smooth_lj):
    atoms = cluster()
    atoms.calc = smooth_lj
    with pytest.raises(ValueError, match=r"images\[0\] is not periodic in all three"):
        IsotropicMTKNPT(atoms, units.fs, 50.0, 0.0, 100 * units.fs, 1000 * units.fs)


def test_model_comes_from_argument_or_shared_calculator(lj_calc64):
    atoms = thermalize(rattled_bulk(repeat=2), 50.0, seed=1)
    VelocityVerlet(atoms, units.fs, model=lj_calc64.model, dtype="float64").run(3)
    assert isinstance(atoms.calc, NVAlchemiCalculator)
    assert atoms.calc.model is lj_calc64.model
    other = rattled_bulk(repeat=2)
    with pytest.raises(ValueError, match=r"images\[0\] has no calculator; pass model="):
        VelocityVerlet(other, units.fs)
    other.calc = NVAlchemiCalculator("lj", device="cpu")
    with pytest.raises(ValueError, match="wraps a different model object"):
        VelocityVerlet(other, units.fs, model=lj_calc64.model)


def test_changes_between_runs_are_picked_up(lj_calc64):
    atoms = thermalize(rattled_bulk(repeat=2), 50.0, seed=1)
    reference = atoms.copy()
    atoms.calc = lj_calc64
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    ours = VelocityVerlet(atoms, units.fs)
    theirs = AseVelocityVerlet(reference, units.fs)
    ours.run(5)
    theirs.run(5)
    for target in (atoms, reference):
        target.positions[0] += [0.05, 0.0, 0.0]
        target.set_momenta(target.get_momenta() * 0.5)
    ours.run(5)
    theirs.run(5)
    assert np.abs(atoms.positions - reference.positions).max() < 1e-9
    assert ours.get_time() == pytest.approx(10 * units.fs)


def test_skin_list_is_reused_and_rebuilt_exactly_when_needed(lj_calc64):
    """Hot argon moves more than half the skin within the run: the list is
    rebuilt a few times, skipped otherwise, and the path is still ASE's."""
    atoms = thermalize(rattled_bulk(repeat=2, seed=5), 1500.0, seed=5)
    reference = atoms.copy()
    atoms.calc = lj_calc64
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    ours = VelocityVerlet(atoms, 2 * units.fs)
    (hook,) = [h for h in ours.engine.hooks if is_neighbor_hook(h)]
    ours.run(100)
    AseVelocityVerlet(reference, 2 * units.fs).run(100)
    assert 2 <= hook.builds <= 60
    assert np.abs(atoms.positions - reference.positions).max() < VERLET_POSITION_TOL


def test_float32_runs(lj_calc32):
    atoms = thermalize(rattled_bulk(repeat=2), 50.0, seed=1)
    atoms.calc = lj_calc32
    dyn = VelocityVerlet(atoms, 2 * units.fs)
    assert dyn.batch.positions.dtype == torch.float32
    dyn.run(10)
    assert np.isfinite(atoms.get_potential_energy())


@pytest.mark.gpu
def test_velocity_verlet_on_cuda_matches_ase_on_cpu():
    images = [
        thermalize(rattled_bulk(repeat=3, seed=1), 60.0, seed=1),
        thermalize(cluster(), 30.0, seed=3),
        thermalize(slab(), 30.0, seed=4),
    ]
    references = [atoms.copy() for atoms in images]
    on_gpu = NVAlchemiCalculator("lj", device="cuda", dtype="float64")
    for atoms in images:
        atoms.calc = on_gpu
    dyn = VelocityVerlet(images, 2 * units.fs)
    assert dyn.batch.positions.device.type == "cuda"
    dyn.run(100)
    for atoms, reference in zip(images, references, strict=True):
        reference.calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
        AseVelocityVerlet(reference, 2 * units.fs).run(100)
        assert np.abs(atoms.positions - reference.positions).max() < VERLET_POSITION_TOL
        assert atoms.get_potential_energy() == pytest.approx(
            reference.get_potential_energy(), abs=1e-8
        )
