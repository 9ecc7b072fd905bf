"""``optimizer + md`` on nvalchemi's FusedStage."""

from __future__ import annotations

import numpy as np
import pytest
from ase import units

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.compose import FINISHED, RELAXING, RUNNING_MD
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.optimize import FIRE2
from tests.structures import cluster, rattled_bulk, thermalize

MD_STEPS = 15


def _images(calc):
    images = [
        rattled_bulk(repeat=2, seed=1, stdev=0.002),
        rattled_bulk(repeat=2, seed=2, stdev=0.12),
        cluster(),
    ]
    for index, atoms in enumerate(images):
        thermalize(atoms, 30.0, seed=index)
        atoms.calc = calc
    return images


def test_each_structure_relaxes_then_runs_exactly_md_steps(lj_calc64):
    images = _images(lj_calc64)
    fused = FIRE2(images, logfile=None) + VelocityVerlet(images, 2 * units.fs)
    assert fused.fmax == 0.05
    fused = FIRE2(images, logfile=None).then(
        VelocityVerlet(images, 2 * units.fs), fmax=0.01, md_steps=MD_STEPS
    )
    history = []
    fused.attach(lambda: history.append(fused.stage.copy()))
    assert fused.run(1000)
    stages = np.array(history)  # (steps + 1, B)
    assert (stages[0] == RELAXING).all()
    assert (stages[-1] == FINISHED).all()
    for column in stages.T:
        entered = np.flatnonzero(column == RUNNING_MD)[0]
        finished = np.flatnonzero(column == FINISHED)[0]
        assert finished - entered == MD_STEPS
    assert stages[:, 0].tolist().index(RUNNING_MD) < stages[:, 1].tolist().index(
        RUNNING_MD
    )


def test_fused_run_equals_relaxing_then_md_one_after_the_other(lj_calc64):
    atoms = rattled_bulk(repeat=2, seed=2, stdev=0.12)
    thermalize(atoms, 30.0, seed=5)
    sequential = atoms.copy()
    initial_momenta = atoms.get_momenta().copy()
    atoms.calc = lj_calc64
    fused = FIRE2(atoms, logfile=None).then(
        VelocityVerlet(atoms, 2 * units.fs), fmax=0.01, md_steps=MD_STEPS
    )
    assert fused.run(1000)

    sequential.calc = NVAlchemiCalculator(
        lj_calc64.model, device="cpu", dtype="float64"
    )
    assert FIRE2(sequential, logfile=None).run(fmax=0.01, steps=1000)
    sequential.set_momenta(initial_momenta)
    VelocityVerlet(sequential, 2 * units.fs).run(MD_STEPS)
    np.testing.assert_allclose(atoms.positions, sequential.positions, atol=1e-7)
    np.testing.assert_allclose(atoms.get_momenta(), sequential.get_momenta(), atol=1e-6)


def test_a_structure_handed_over_keeps_its_momenta_until_its_first_md_step(
    lj_calc64,
):
    """At the hand-over step its velocities are still the optimizer's."""
    images = _images(lj_calc64)
    initial = [atoms.get_momenta().copy() for atoms in images]
    fused = FIRE2(images, logfile=None).then(
        VelocityVerlet(images, 2 * units.fs), fmax=0.01, md_steps=MD_STEPS
    )
    assert not fused.run(1)
    assert fused.stage.tolist() == [RUNNING_MD, RELAXING, RELAXING]
    for atoms, momenta in zip(images, initial, strict=True):
        np.testing.assert_array_equal(atoms.get_momenta(), momenta)
    assert not fused.run(1)  # its first MD step starts from its own momenta
    assert not np.array_equal(images[0].get_momenta(), initial[0])


def test_composition_checks_its_parts(lj_calc64):
    images = _images(lj_calc64)
    others = [a.copy() for a in images]
    for atoms in others:
        atoms.calc = lj_calc64
    with pytest.raises(ValueError, match="same Atoms objects"):
        FIRE2(images, logfile=None) + VelocityVerlet(others, units.fs)
    with pytest.raises(TypeError, match="optimizer followed by"):
        FIRE2(images, logfile=None).then(FIRE2(images, logfile=None))


@pytest.mark.parametrize(
    ("split", "stages"),
    [(3, [RUNNING_MD, RELAXING, RELAXING]), (25, [FINISHED, RELAXING, RELAXING])],
)
def test_restart_continues_the_fused_run_bit_for_bit(
    lj_calc64, tmp_path, split, stages
):
    from nvalchemi_ase.md import Langevin

    def make(restart=None):
        images = _images(lj_calc64)
        md = Langevin(
            images, 2 * units.fs, temperature_K=30, friction=0.01 / units.fs, seed=4
        )
        return FIRE2(images, logfile=None).then(
            md, fmax=0.01, md_steps=MD_STEPS, restart=restart
        )

    reference = make()
    assert reference.run(1000)
    path = tmp_path / "fused.npz"
    first = make(path)
    assert not first.run(split)
    assert first.stage.tolist() == stages  # mid-MD, then one finished
    second = make(path)
    assert second.nsteps == split
    assert second.run(1000)
    assert second.nsteps == reference.nsteps
    np.testing.assert_array_equal(second.stage, reference.stage)
    for ours, theirs in zip(second.images, reference.images, strict=True):
        np.testing.assert_array_equal(ours.positions, theirs.positions)
        np.testing.assert_array_equal(ours.get_momenta(), theirs.get_momenta())
