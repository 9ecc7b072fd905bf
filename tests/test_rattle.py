"""``FixBondLengths`` and ``FixLinearTriatomic`` (RATTLE family), batched, against ASE.

References: ASE's own constraint methods on the same input (the batched
SHAKE/RATTLE iterate ASE's sequence of updates), and ASE's ``VelocityVerlet``,
``FIRE`` and ``BFGS`` with the same constraint on the same model, step for
step. Rigid water boxes of different sizes share one batch; the model is a
soft LJ (every pair, σ = 0.8 Å), so intramolecular pairs stay mild.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.constraints import FixBondLength, FixBondLengths, FixLinearTriatomic
from ase.io import read, write
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from ase.optimize import BFGS as AseBFGS
from ase.optimize import FIRE as AseFIRE

from nvalchemi_ase import NVAlchemiCalculator, atoms_to_batch
from nvalchemi_ase.dynamics.constraints import BatchConstraints
from nvalchemi_ase.md import Langevin, VelocityVerlet
from nvalchemi_ase.models import load_model
from nvalchemi_ase.optimize import BFGS, FIRE
from tests.structures import cluster, rattled_bulk, thermalize

# Trajectories of the same integrator and constraint: ASE's tolerance (1e-13
# on the correction factor) and round-off, grown over a few tens of steps.
POSITIONS_TOL = 1e-9  # Å
MOMENTA_TOL = 1e-8  # amu Å / ASE time
# A bond after SHAKE: |x| <= 1e-13 moves it by about |x| * length.
BOND_TOL = 1e-10  # Å
# One call of a constraint method against ASE's on the same input.
METHOD_TOL = 1e-12
# Optimizers converge to fmax; their paths agree to round-off of many steps.
OPTIMIZER_POSITIONS_TOL = 1e-7  # Å
DT = 1.0 * units.fs

O_H, HOH = 0.9572, np.radians(104.52)  # TIP3P geometry
C_O = 1.16


@pytest.fixture(scope="module")
def soft_lj():
    return load_model("lj", epsilon=0.01, sigma=0.8, cutoff=4.0, switch_width=1.0)


def _rotation(rng):
    q = rng.normal(size=4)
    a, b, c, d = q / np.linalg.norm(q)
    return np.array(
        [
            [a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c)],
            [2 * (b * c + a * d), a * a - b * b + c * c - d * d, 2 * (c * d - a * b)],
            [2 * (b * d - a * c), 2 * (c * d + a * b), a * a - b * b - c * c + d * d],
        ]
    )


def _molecules(shape, symbols, grid, spacing, seed, pbc=True):
    rng = np.random.default_rng(seed)
    sites = list(np.ndindex(*grid))
    positions = [shape @ _rotation(rng).T + spacing * np.array(s) for s in sites]
    return Atoms(
        symbols * len(sites),
        positions=np.concatenate(positions),
        cell=spacing * np.array(grid, dtype=float),
        pbc=pbc,
    )


def water_box(grid, seed, spacing=3.1, temperature_K=300.0):
    """Rigid TIP3P-shaped waters on a ``grid``, three bonds each, thermal momenta."""
    shape = np.array(
        [[0, 0, 0], [O_H, 0, 0], [O_H * np.cos(HOH), O_H * np.sin(HOH), 0]]
    )
    atoms = _molecules(shape, "OHH", grid, spacing, seed)
    # molecules straddle the boundary once wrapped: bonds need the minimum image
    atoms.wrap()
    count = len(atoms) // 3
    pairs = [
        (3 * m + i, 3 * m + j)
        for m in range(count)
        for i, j in ((0, 1), (0, 2), (1, 2))
    ]
    atoms.set_constraint(FixBondLengths(pairs))
    return thermalize(atoms, temperature_K, seed)


def co2_box(grid, seed, spacing=3.6, pbc=True):
    """Linear CO2 (O–C–O) on a ``grid``, FixLinearTriatomic, thermal momenta."""
    shape = np.array([[-C_O, 0, 0], [0, 0, 0], [C_O, 0, 0]])
    atoms = _molecules(shape, "OCO", grid, spacing, seed, pbc=pbc)
    count = len(atoms) // 3
    atoms.set_constraint(
        FixLinearTriatomic([(3 * m, 3 * m + 1, 3 * m + 2) for m in range(count)])
    )
    return thermalize(atoms, 300.0, seed)


def _ase_copy(atoms, model):
    """The same structure with a fresh copy of its constraint, for ASE's classes."""
    copy = atoms.copy()  # copies the constraints (bond lengths not yet set)
    copy.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    return copy


def _bond_errors(atoms):
    constraint = atoms.constraints[0]
    pairs = constraint.pairs
    lengths = np.array([atoms.get_distance(a, b, mic=True) for a, b in pairs])
    return np.abs(lengths - constraint.bondlengths)


# -- the constraint methods, batched, against ASE's ------------------------------------


def _displaced(images, scale, seed):
    rng = np.random.default_rng(seed)
    return [
        a.positions + rng.normal(scale=scale, size=a.positions.shape) for a in images
    ]


def test_shake_and_rattle_equal_ases_methods_for_a_whole_batch():
    images = [
        water_box((2, 2, 2), seed=1),
        water_box((2, 2, 3), seed=2),
        co2_box((2, 2, 2), seed=3, pbc=False),
    ]
    images[2].positions += 0.0  # non-periodic, zero-padded cell
    references = [a.copy() for a in images]
    batch = atoms_to_batch(
        images, device="cpu", dtype=torch.float64, warn_dropped=False
    )
    constraints = BatchConstraints(images, batch)
    new = _displaced(images, 0.02, seed=4)
    old_t = batch.positions.detach().clone()
    new_t = torch.tensor(np.concatenate(new))
    constraints._saved["positions"] = old_t
    constraints._rigid_positions(old_t, new_t, batch)
    vectors = np.random.default_rng(5).normal(size=new_t.shape)
    velocities = torch.tensor(vectors)
    constraints._rigid_velocities(velocities, batch)
    forces = torch.tensor(vectors)
    constraints._md = False
    constraints._rigid_forces(forces, batch)
    start = 0
    for atoms, reference, moved in zip(images, references, new, strict=True):
        stop = start + len(atoms)
        constraint = reference.constraints[0]
        expected = moved.copy()
        constraint.adjust_positions(reference, expected)
        np.testing.assert_allclose(
            new_t[start:stop].numpy(), expected, rtol=0, atol=METHOD_TOL
        )
        masses = reference.get_masses()[:, None]
        momenta = vectors[start:stop] * masses
        constraint.adjust_momenta(reference, momenta)
        np.testing.assert_allclose(
            velocities[start:stop].numpy(), momenta / masses, rtol=0, atol=METHOD_TOL
        )
        expected_forces = vectors[start:stop].copy()
        constraint.adjust_forces(reference, expected_forces)
        np.testing.assert_allclose(
            forces[start:stop].numpy(), expected_forces, rtol=0, atol=METHOD_TOL
        )
        start = stop


# -- molecular dynamics ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [pytest.param(water_box, marks=pytest.mark.slow), co2_box],  # water: ~13 CPU-s
    ids=["water", "co2"],
)
def test_velocity_verlet_equals_ases_step_for_step(make, soft_lj):
    images = [make((2, 2, 2), seed=1), make((2, 2, 3), seed=2)]
    references = [_ase_copy(a, soft_lj) for a in images]
    dyn = VelocityVerlet(images, DT, model=soft_lj, device="cpu", dtype="float64")
    ase_dyns = [AseVelocityVerlet(r, DT) for r in references]
    for _ in range(2):
        dyn.run(6)
        for ase_dyn in ase_dyns:
            ase_dyn.run(6)
        for atoms, reference in zip(images, references, strict=True):
            np.testing.assert_allclose(
                atoms.positions, reference.positions, rtol=0, atol=POSITIONS_TOL
            )
            np.testing.assert_allclose(
                atoms.get_momenta(), reference.get_momenta(), rtol=0, atol=MOMENTA_TOL
            )
            assert atoms.get_temperature() == pytest.approx(
                reference.get_temperature(), rel=1e-9
            )
    if make is water_box:
        for atoms in images:
            assert _bond_errors(atoms).max() < BOND_TOL


@pytest.mark.slow  # ~11 CPU-s
def test_langevin_without_friction_is_ases_velocity_verlet(soft_lj):
    images = [water_box((2, 2, 2), seed=3), water_box((2, 2, 3), seed=4)]
    references = [_ase_copy(a, soft_lj) for a in images]
    dyn = Langevin(
        images,
        DT,
        temperature_K=300,
        friction=0.0,
        seed=1,
        model=soft_lj,
        device="cpu",
        dtype="float64",
    )
    dyn.run(15)
    for reference in references:
        AseVelocityVerlet(reference, DT).run(15)
    for atoms, reference in zip(images, references, strict=True):
        np.testing.assert_allclose(
            atoms.positions, reference.positions, rtol=0, atol=POSITIONS_TOL
        )


@pytest.mark.slow
def test_langevin_holds_bonds_and_reaches_the_temperature_ase_counts(soft_lj):
    images = [
        water_box((2, 2, 2), seed=5, temperature_K=200),
        water_box((3, 3, 3), seed=6, temperature_K=200),
    ]
    dyn = Langevin(
        images,
        2 * units.fs,
        temperature_K=300,
        friction=0.05 / units.fs,
        seed=3,
        model=soft_lj,
        device="cpu",
        dtype="float64",
    )
    temperatures = []

    def record():
        temperatures.append([atoms.get_temperature() for atoms in images])
        for atoms in images:
            assert _bond_errors(atoms).max() < BOND_TOL

    dyn.attach(record, interval=5)
    dyn.run(400)
    mean = np.mean(temperatures[len(temperatures) // 2 :], axis=0)
    # 8 and 27 waters, 6 degrees of freedom each: ~5 % noise on the mean
    np.testing.assert_allclose(mean, 300.0, rtol=0.25)
    np.testing.assert_allclose(
        dyn.per_structure_thermo()["temperature"],
        [atoms.get_temperature() for atoms in images],
        rtol=1e-10,
    )


# -- optimizers ------------------------------------------------------------------------


STEPS = 15  # optimizer steps compared (not all converge by then)


def _argon_with_bonds():
    small, large = cluster(), rattled_bulk(repeat=2, seed=3)
    small.set_constraint(FixBondLength(0, 1))
    large.set_constraint(FixBondLengths([(0, 1), (1, 2), (5, 9)]))
    return [small, large]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(FIRE, AseFIRE), pytest.param(BFGS, AseBFGS, marks=pytest.mark.slow)],
    ids=["FIRE", "BFGS"],  # BFGS: ~9 CPU-s
)
def test_optimizers_with_fix_bond_length_agree_with_ases(ours, theirs, lj_calc64):
    images = _argon_with_bonds()
    references = [_ase_copy(a, lj_calc64.model) for a in images]
    lengths = [
        [a.get_distance(i, j, mic=True) for i, j in a.constraints[0].pairs]
        for a in images
    ]
    opt = ours(images, model=lj_calc64.model, logfile=None)
    opt.run(fmax=0.01, steps=STEPS)
    for atoms, reference, bonds in zip(images, references, lengths, strict=True):
        ase_opt = theirs(reference, logfile=None)
        ase_opt.run(fmax=0.01, steps=STEPS)
        np.testing.assert_allclose(
            atoms.positions, reference.positions, rtol=0, atol=OPTIMIZER_POSITIONS_TOL
        )
        np.testing.assert_allclose(
            atoms.get_forces(), reference.get_forces(), rtol=0, atol=1e-8
        )
        assert _bond_errors(atoms).max() < BOND_TOL
        np.testing.assert_allclose(atoms.constraints[0].bondlengths, bonds, rtol=1e-14)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(FIRE, AseFIRE), pytest.param(BFGS, AseBFGS, marks=pytest.mark.slow)],
    ids=["FIRE", "BFGS"],  # BFGS: ~9 CPU-s
)
def test_optimizers_project_forces_with_the_atoms_masses_as_ase(
    ours, theirs, lj_calc64
):
    """Unequal masses: ASE's ``adjust_forces`` weighs with ``get_masses()``.

    The optimizers' own dynamics use unit masses; the constraint must not, or
    the logged fmax and the steps differ from ASE's (and a trajectory frame's
    forces, its constraint applied again on reading, from the log).
    """
    images = _argon_with_bonds()
    rng = np.random.default_rng(24)
    for atoms in images:
        atoms.set_masses(rng.uniform(1.0, 60.0, len(atoms)))
    references = [_ase_copy(a, lj_calc64.model) for a in images]
    opt = ours(images, model=lj_calc64.model, logfile=None)
    opt.run(fmax=0.01, steps=STEPS)
    for atoms, reference in zip(images, references, strict=True):
        theirs(reference, logfile=None).run(fmax=0.01, steps=STEPS)
        np.testing.assert_allclose(
            atoms.positions, reference.positions, rtol=0, atol=OPTIMIZER_POSITIONS_TOL
        )
        np.testing.assert_allclose(
            atoms.get_forces(), reference.get_forces(), rtol=0, atol=1e-8
        )


# -- failures, the user's objects, files, restart ------------------------------------


def test_bonds_that_cannot_converge_fail_their_structure_only(soft_lj):
    images = [
        water_box((2, 2, 2), seed=7),
        water_box((2, 2, 2), seed=8),
        water_box((2, 2, 2), seed=9),
    ]
    alone = _ase_copy(images[2], soft_lj)
    broken = images[1].constraints[0]
    lengths = broken.initialize_bond_lengths(images[1])
    lengths[2::3] = 4.0  # H–H longer than O–H + O–H: no solution
    broken.bondlengths = lengths
    broken.maxiter = 25
    dyn = VelocityVerlet(images, DT, model=soft_lj, device="cpu", dtype="float64")
    with pytest.warns(UserWarning, match="did not converge"):
        dyn.run(5)
    assert [failure.index for failure in dyn.failures] == [1]
    assert "FixBondLengths" in dyn.failures[0].reason
    AseVelocityVerlet(alone, DT).run(5)
    np.testing.assert_allclose(
        images[2].positions, alone.positions, rtol=0, atol=POSITIONS_TOL
    )
    assert _bond_errors(images[0]).max() < BOND_TOL


def test_users_atoms_keep_their_constraints_and_files_stay_readable(tmp_path, soft_lj):
    images = [water_box((2, 2, 2), seed=10), co2_box((2, 2, 2), seed=11)]
    pairs = images[0].constraints[0].pairs.copy()
    triples = images[1].constraints[0].triples.copy()
    dyn = VelocityVerlet(images, DT, model=soft_lj, device="cpu", dtype="float64")
    dyn.run(5)
    assert [type(a.constraints[0]) for a in images] == [
        FixBondLengths,
        FixLinearTriatomic,
    ]
    np.testing.assert_array_equal(images[0].constraints[0].pairs, pairs)
    np.testing.assert_array_equal(images[1].constraints[0].triples, triples)
    for atoms in images:
        write(tmp_path / "out.traj", atoms)
        back = read(tmp_path / "out.traj")
        assert type(back.constraints[0]) is type(atoms.constraints[0])
        np.testing.assert_allclose(back.positions, atoms.positions, rtol=0, atol=1e-12)
        assert back.get_potential_energy() == pytest.approx(
            atoms.get_potential_energy()
        )
        write(tmp_path / "out.extxyz", atoms)
        frame = read(tmp_path / "out.extxyz")
        np.testing.assert_allclose(frame.positions, atoms.positions, rtol=0, atol=1e-6)
        assert frame.get_potential_energy() == pytest.approx(
            atoms.get_potential_energy()
        )


def test_restart_continues_exactly(tmp_path, soft_lj):
    def make(**kwargs):
        return VelocityVerlet(
            [water_box((2, 2, 2), seed=12), co2_box((2, 2, 2), seed=13)],
            DT,
            model=soft_lj,
            device="cpu",
            dtype="float64",
            **kwargs,
        )

    reference = make()
    reference.run(10)
    path = tmp_path / "restart.npz"
    first = make(restart=path)
    first.run(5)
    second = make(restart=path)  # fresh input: bond lengths re-derived from it
    second.run(5)
    for ours, theirs in zip(second.images, reference.images, strict=True):
        np.testing.assert_array_equal(ours.positions, theirs.positions)
        np.testing.assert_array_equal(ours.get_momenta(), theirs.get_momenta())


def test_relax_plus_md_refuses_rigid_constraints(soft_lj):
    images = [water_box((1, 1, 2), seed=14)]
    options = {"model": soft_lj, "device": "cpu", "dtype": "float64"}
    optimizer = FIRE(images, logfile=None, **options)
    md = VelocityVerlet(images, DT, **options)
    with pytest.raises(ValueError, match=r"images\[0\] has constraint FixBondLengths"):
        optimizer + md


def test_bonds_to_fixed_atoms_move_only_the_free_atom(soft_lj):
    from ase.constraints import FixAtoms

    images = [water_box((1, 2, 2), seed=15), water_box((2, 2, 2), seed=16)]
    fixed = [0, 4]  # an oxygen, a hydrogen
    images[1].set_constraint([FixAtoms(indices=fixed), images[1].constraints[0]])
    start = images[1].positions[fixed].copy()
    dyn = VelocityVerlet(images, DT, model=soft_lj, device="cpu", dtype="float64")
    dyn.run(10)
    np.testing.assert_array_equal(images[1].positions[fixed], start)
    for atoms in images:
        bonds = next(c for c in atoms.constraints if isinstance(c, FixBondLengths))
        lengths = [atoms.get_distance(a, b, mic=True) for a, b in bonds.pairs]
        np.testing.assert_allclose(lengths, bonds.bondlengths, rtol=0, atol=BOND_TOL)
