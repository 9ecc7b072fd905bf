"""Bussi, NVT Berendsen and Andersen engines; nvalchemi's guide's Verlet from ASE.

The guide's engine is ``tests/seed_velocity_verlet.py`` (the "Complete example:
Velocity Verlet" of nvalchemi's dynamics guide, pasted verbatim), run through
``nvalchemi_ase.wrap``.

Degrees of freedom: temperatures are ASE's kinetic temperatures, 2 E_kin / (N_f
k_B) with N_f = 3 × (atoms not fixed). Bussi's thermostat uses the same N_f, so
its kinetic energy follows the canonical distribution of N_f quadratic terms:
mean T0 and variance 2 T0² / N_f. Andersen with ``fixcm=False`` thermalises all
3N velocity components (same mean and variance); with ``fixcm=True`` the
centre-of-mass motion is removed, leaving 3N − 3 of them, so the 3N-based
temperature has mean T0 (3N − 3) / (3N).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.constraints import FixAtoms
from ase.md.nvtberendsen import NVTBerendsen as AseNVTBerendsen

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.dynamics.logs import internal
from nvalchemi_ase.dynamics.neighbors import neighbor_hooks
from nvalchemi_ase.md import Andersen, Bussi, NVTBerendsen
from nvalchemi_ase.units import ase_time_to_fs
from nvalchemi_ase.wrap import md_class
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import rattled_bulk, thermalize

BERENDSEN_VELOCITY_TOL = 1e-10  # Å/ASE-time over 100 steps (velocities ~5e-2)
MEAN_T_RTOL = 0.02  # <T> within 2 % of the target: several standard errors here
CANONICAL_VARIANCE_RTOL = 0.15  # Var(T) within 15 % of 2 T^2 / (3N)
BERENDSEN_MAX_VARIANCE_RATIO = 0.5  # "much smaller" than canonical
# fixcm=True vs fixcm=False expectations differ by 3/(3N) = 3.1 % for N = 32
FIXCM_MEAN_RTOL = 0.015
DRIFT_EV_PER_ATOM = 1e-4  # total-energy drift over 1 ps, smooth LJ, 1 fs
CONSERVED_EV_PER_ATOM = 1e-5  # Bussi's E_tot - transferred energy, 150 fs
T0 = 100.0  # K


def thermal_batch(count, calc, temperature=T0, repeat=2):
    images = [
        thermalize(rattled_bulk(repeat=repeat, seed=10 + i), temperature, seed=40 + i)
        for i in range(count)
    ]
    for atoms in images:
        atoms.calc = calc
    return images


def sample_temperatures(dyn, steps, discard):
    """Per-step, per-structure temperatures (K) after ``discard`` steps, (S, B)."""
    samples = []
    dyn.attach(
        internal(lambda: samples.append(dyn.per_structure_thermo()["temperature"]))
    )
    dyn.run(steps)
    return np.array(samples[discard + 1 :])


def variance_ratio(samples, natoms, dof_per_atom=3.0):
    canonical = 2.0 * T0**2 / (dof_per_atom * natoms)
    return samples.var() / canonical


# -- NVT Berendsen against ASE, step for step -----------------------------------------


@pytest.mark.parametrize(("fixcm", "fixed"), [(True, []), (False, [0, 5, 11])])
def test_nvtberendsen_velocities_match_ase_for_100_steps(fixcm, fixed, lj_calc64):
    start = rattled_bulk(repeat=2, seed=1)
    start.set_constraint(FixAtoms(indices=fixed))
    thermalize(start, 60.0, seed=3)
    atoms, reference = start.copy(), start.copy()
    atoms.calc = lj_calc64
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    ours, theirs = [], []
    dyn = NVTBerendsen(atoms, 2 * units.fs, T0, 20 * units.fs, fixcm=fixcm)
    dyn.attach(lambda: ours.append(atoms.get_velocities()))
    dyn.run(100)
    ase_dyn = AseNVTBerendsen(
        reference, 2 * units.fs, temperature_K=T0, taut=20 * units.fs, fixcm=fixcm
    )
    ase_dyn.attach(lambda: theirs.append(reference.get_velocities()))
    ase_dyn.run(100)
    assert len(ours) == len(theirs) == 101
    difference = max(np.abs(a - b).max() for a, b in zip(ours, theirs, strict=True))
    assert difference < BERENDSEN_VELOCITY_TOL
    assert atoms.get_temperature() > 70.0  # the thermostat did heat it


def test_per_structure_targets_each_match_their_own_ase_run(lj_calc64):
    images = thermal_batch(2, lj_calc64, temperature=60.0)
    references = [atoms.copy() for atoms in images]
    targets, couplings = [80.0, 140.0], [10 * units.fs, 40 * units.fs]
    NVTBerendsen(images, 2 * units.fs, targets, couplings, fixcm=False).run(50)
    for atoms, reference, target, taut in zip(
        images, references, targets, couplings, strict=True
    ):
        reference.calc = NVAlchemiCalculator(
            lj_calc64.model, device="cpu", dtype="float64"
        )
        AseNVTBerendsen(
            reference, 2 * units.fs, temperature_K=target, taut=taut, fixcm=False
        ).run(50)
        difference = np.abs(atoms.get_velocities() - reference.get_velocities()).max()
        assert difference < BERENDSEN_VELOCITY_TOL


# -- statistics on LJ argon at 100 K ---------------------------------------------------


@pytest.mark.slow
def test_bussi_samples_the_canonical_kinetic_energy(lj_calc64):
    images = thermal_batch(12, lj_calc64)
    dyn = Bussi(images, 5 * units.fs, T0, 10 * units.fs, seed=11)
    samples = sample_temperatures(dyn, steps=500, discard=100)
    assert samples.mean() == pytest.approx(T0, rel=MEAN_T_RTOL)
    ratio = variance_ratio(samples, len(images[0]))
    assert ratio == pytest.approx(1.0, abs=CANONICAL_VARIANCE_RTOL)


@pytest.mark.slow
def test_andersen_samples_the_canonical_kinetic_energy(lj_calc64):
    images = thermal_batch(12, lj_calc64)
    dyn = Andersen(images, 5 * units.fs, T0, 0.2, fixcm=False, seed=12)
    samples = sample_temperatures(dyn, steps=700, discard=100)
    assert samples.mean() == pytest.approx(T0, rel=MEAN_T_RTOL)
    ratio = variance_ratio(samples, len(images[0]))
    assert ratio == pytest.approx(1.0, abs=CANONICAL_VARIANCE_RTOL)


@pytest.mark.slow
def test_andersen_with_fixcm_samples_3n_minus_3_degrees_of_freedom(lj_calc64):
    images = thermal_batch(12, lj_calc64)
    natoms = len(images[0])
    dyn = Andersen(images, 5 * units.fs, T0, 0.2, fixcm=True, seed=13)
    samples = sample_temperatures(dyn, steps=400, discard=100)
    kept = (3 * natoms - 3) / (3 * natoms)  # 3N-based temperature of 3N - 3 dof
    assert samples.mean() == pytest.approx(T0 * kept, rel=FIXCM_MEAN_RTOL)
    ratio = variance_ratio(samples, natoms, dof_per_atom=3.0 * kept) / kept**2
    assert ratio == pytest.approx(1.0, abs=CANONICAL_VARIANCE_RTOL)
    momenta = np.array([atoms.get_momenta().sum(axis=0) for atoms in images])
    assert np.abs(momenta).max() < 1e-10


@pytest.mark.slow
def test_berendsen_keeps_the_mean_but_suppresses_fluctuations(lj_calc64):
    images = thermal_batch(12, lj_calc64)
    dyn = NVTBerendsen(images, 5 * units.fs, T0, 20 * units.fs)
    samples = sample_temperatures(dyn, steps=500, discard=150)
    assert samples.mean() == pytest.approx(T0, rel=MEAN_T_RTOL)
    assert variance_ratio(samples, len(images[0])) < BERENDSEN_MAX_VARIANCE_RATIO


def test_bussi_conserves_energy_minus_transferred_energy(smooth_lj):
    images = thermal_batch(2, smooth_lj, temperature=40.0, repeat=2)
    dyn = Bussi(images, 1 * units.fs, [90.0, 120.0], 20 * units.fs, seed=3)
    conserved = []

    def record():
        thermo = dyn.per_structure_thermo()
        total = thermo["epot"] + thermo["ekin"]
        conserved.append((total - dyn.transferred_energy) / thermo["natoms"])

    dyn.attach(internal(record))
    dyn.run(150)
    conserved = np.array(conserved)
    assert np.ptp(conserved, axis=0).max() < CONSERVED_EV_PER_ATOM
    transferred = dyn.transferred_energy / np.array([len(a) for a in images])
    assert np.abs(transferred).min() > 100 * CONSERVED_EV_PER_ATOM


# -- constraints, seeds, status -----------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda images: Bussi(images, 2 * units.fs, T0, 20 * units.fs, seed=1),
        lambda images: NVTBerendsen(images, 2 * units.fs, T0, 20 * units.fs, False),
        lambda images: Andersen(images, 2 * units.fs, T0, 0.3, seed=1),
    ],
)
def test_frozen_atoms_stay_and_do_not_count(make, lj_calc64):
    atoms = thermalize(rattled_bulk(repeat=2), 80.0, seed=2)
    fixed = [0, 3, 7]
    atoms.set_constraint(FixAtoms(indices=fixed))
    start = atoms.positions[fixed].copy()
    atoms.calc = lj_calc64
    dyn = make(atoms)
    dyn.run(30)
    np.testing.assert_array_equal(atoms.positions[fixed], start)
    np.testing.assert_array_equal(atoms.get_momenta()[fixed], 0.0)
    assert dyn.per_structure_thermo()["temperature"][0] == pytest.approx(
        atoms.get_temperature(), rel=1e-10
    )


@pytest.mark.parametrize("dynamics_class", [Bussi, Andersen])
def test_seeds_reproduce_and_differ(dynamics_class, lj_calc64):
    finals = {}
    for seed in (5, 5, 6):
        images = thermal_batch(2, lj_calc64)
        extra = {"andersen_prob": 0.3} if dynamics_class is Andersen else {}
        extra = extra or {"taut": 10 * units.fs}
        dynamics_class(images, 2 * units.fs, T0, seed=seed, **extra).run(10)
        finals.setdefault(seed, []).append(images[1].get_velocities())
    np.testing.assert_array_equal(finals[5][0], finals[5][1])
    assert np.abs(finals[5][0] - finals[6][0]).max() > 1e-4


def test_graphs_past_exit_status_keep_positions_velocities_and_state(lj_calc64):
    engines = import_quietly("nvalchemi_ase.engines")
    model = lj_calc64.model
    engine = engines.NVTBussi(model, dt=2.0, temperature=T0, taut=10.0, random_seed=1)
    for hook in neighbor_hooks(model, skin=1.0):
        engine.register_hook(hook)
    batch = atoms_to_batch(
        thermal_batch(2, lj_calc64), device="cpu", dtype=torch.float64
    )
    batch["status"] = torch.tensor([[0], [1]])
    before = {key: batch[key].detach().clone() for key in ("positions", "velocities")}
    for _ in range(3):
        engine.step(batch)
    ptr = int(batch.batch_ptr[1])
    for key, value in before.items():
        assert torch.equal(batch[key][ptr:].detach(), value[ptr:]), key
        assert not torch.equal(batch[key][:ptr].detach(), value[:ptr]), key
    energy = engine.transferred_energy
    assert energy[1] == 0.0
    assert energy[0] != 0.0


# -- nvalchemi's guide's Verlet (tests/seed_velocity_verlet.py) through wrap ---------


@pytest.mark.slow
def test_seed_velocity_verlet_conserves_energy_over_one_ps(smooth_lj):
    from tests.seed_velocity_verlet import VelocityVerlet as SeedVelocityVerlet

    ase_verlet = md_class(SeedVelocityVerlet, timestep_unit="ase")
    images = thermal_batch(2, smooth_lj, temperature=60.0, repeat=3)
    timestep = 2 * units.fs
    steps = round(1000.0 / ase_time_to_fs(timestep))  # 1 ps
    dyn = ase_verlet(images, timestep)
    totals = []

    def record():
        thermo = dyn.per_structure_thermo()
        totals.append((thermo["epot"] + thermo["ekin"]) / thermo["natoms"])

    dyn.attach(internal(record), interval=10)
    dyn.run(steps)
    totals = np.array(totals)
    drift = np.abs(totals - totals[0]).max()
    assert drift < DRIFT_EV_PER_ATOM
    assert images[0].get_temperature() > 10.0  # it did move


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda i: Bussi(i, units.fs, T0, -5.0), r"taut for images\[0\] is -5.0"),
        (lambda i: NVTBerendsen(i, units.fs, T0, 0.0), r"taut for images\[0\] is 0.0"),
        (lambda i: Andersen(i, units.fs, T0, -0.1), r"andersen_prob for images\[0\]"),
        (
            lambda i: Andersen(i, units.fs, T0, [0.1, 1.5]),
            r"andersen_prob for images\[1\] is 1.5; it must be in \[0, 1\]",
        ),
        (
            lambda i: Bussi(i, units.fs, [T0, T0, T0], 10.0),
            r"temperature_K has shape \(3,\)",
        ),
        (
            lambda i: NVTBerendsen(i, units.fs, T0, [10.0, 20.0, 30.0]),
            r"taut has shape \(3,\)",
        ),
        (lambda i: Andersen(i, -units.fs, T0, 0.1), "timestep must be positive"),
        (
            lambda i: Bussi(i, units.fs, T0, 10.0, seed=1, rng=np.random.default_rng()),
            "either seed or rng",
        ),
    ],
)
def test_bad_arguments_raise_before_any_step(make, message, lj_calc64):
    images = thermal_batch(2, lj_calc64)
    before = [snapshot(atoms) for atoms in images]
    with pytest.raises(ValueError, match=message):
        make(images)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_bussi_refuses_structures_at_rest(lj_calc64):
    images = thermal_batch(2, lj_calc64)
    images[1].set_momenta(np.zeros((len(images[1]), 3)))
    before = [snapshot(atoms) for atoms in images]
    with pytest.raises(ValueError, match=r"images\[1\] has zero kinetic energy"):
        Bussi(images, units.fs, T0, 10 * units.fs)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_berendsen_fixcm_with_fixed_atoms_is_refused(lj_calc64):
    images = thermal_batch(2, lj_calc64)
    images[0].set_constraint(FixAtoms(indices=[0]))
    before = [snapshot(atoms) for atoms in images]
    with pytest.raises(ValueError, match=r"images\[0\] has FixAtoms and fixcm=True"):
        NVTBerendsen(images, units.fs, T0, 10 * units.fs)
    for snap, atoms in zip(before, images, strict=True):
        assert_same_snapshot(snap, atoms)


def test_engines_validate_their_own_parameters(lj_calc64):
    engines = import_quietly("nvalchemi_ase.engines")
    model = lj_calc64.model
    with pytest.raises(ValueError, match=r"taut must be finite and > 0\.0"):
        engines.NVTBerendsen(model, dt=1.0, temperature=T0, taut=0.0)
    with pytest.raises(ValueError, match="collision_probability"):
        engines.NVTAndersen(model, dt=1.0, temperature=T0, collision_probability=2.0)
    with pytest.raises(ValueError, match="dt"):
        engines.NVTBussi(model, dt=-1.0, temperature=T0, taut=10.0)
    with pytest.raises(NotImplementedError, match="by_group"):
        engines.NVTBussi(model, dt=1.0, temperature=T0, taut=10.0, by_group=True)
