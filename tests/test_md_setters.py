"""ASE's MD attributes and setters: ``Langevin``, ``Andersen``, ``Bussi``.

The references are deterministic wherever possible: a thermostat switched off
by its setter (friction 0, collision probability 0) must continue exactly as
velocity Verlet from the same state, with the new time step if one was set;
attributes must equal those of ASE's own class built with the same arguments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.constraints import FixAtoms
from ase.md.andersen import Andersen as AseAndersen
from ase.md.bussi import Bussi as AseBussi
from ase.md.langevin import Langevin as AseLangevin
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import Andersen, Bussi, Langevin, VelocityVerlet
from tests._tolerances import EXACT
from tests.structures import rattled_bulk, thermalize

DT = 2 * units.fs
T0 = 80.0


def _structures():
    return [
        thermalize(rattled_bulk(repeat=2, seed=1), T0, seed=3),
        thermalize(rattled_bulk(repeat=2, seed=2).repeat((1, 1, 2)), T0, seed=4),
    ]


def _verlet_reference(images, model, timestep, steps):
    """Velocity Verlet (ours, checked against ASE's elsewhere) from ``images``."""
    copies = [atoms.copy() for atoms in images]
    VelocityVerlet(copies, timestep, model=model).run(steps)
    return copies


def _assert_same(images, references):
    for atoms, reference in zip(images, references, strict=True):
        np.testing.assert_allclose(
            atoms.positions, reference.positions, atol=EXACT[torch.float64]
        )
        np.testing.assert_allclose(
            atoms.get_momenta(), reference.get_momenta(), atol=EXACT[torch.float64]
        )


def test_langevin_without_friction_is_ases_velocity_verlet(lj_calc64):
    start = _structures()[0]
    atoms, reference = start.copy(), start.copy()
    Langevin(atoms, DT, T0, 0.0, seed=1, model=lj_calc64.model).run(30)
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    AseVelocityVerlet(reference, DT).run(30)
    _assert_same([atoms], [reference])


def test_langevin_setters_take_effect_at_the_next_step(lj_calc64):
    images = _structures()
    dyn = Langevin(images, DT, T0, 0.02 / units.fs, seed=2, model=lj_calc64.model)
    dyn.run(20)
    middle = [atoms.copy() for atoms in images]
    dyn.set_friction(0.0)
    dyn.set_timestep(1.5 * units.fs)
    dyn.run(20)
    _assert_same(images, _verlet_reference(middle, lj_calc64.model, 1.5 * units.fs, 20))
    assert np.allclose(dyn.fr, 0.0)
    assert dyn.dt == 1.5 * units.fs


@pytest.mark.slow
def test_langevin_set_temperature_moves_the_bath(lj_calc64):
    images = [thermalize(rattled_bulk(repeat=2, seed=s), T0, seed=s) for s in (5, 6)]
    dyn = Langevin(images, DT, T0, 0.1 / units.fs, seed=3, model=lj_calc64.model)
    dyn.run(10)
    dyn.set_temperature(temperature_K=[40.0, 160.0])
    temperatures = []
    dyn.attach(lambda: temperatures.append(dyn.per_structure_thermo()["temperature"]))
    dyn.run(400)
    mean = np.array(temperatures[100:]).mean(axis=0)
    np.testing.assert_allclose(mean, [40.0, 160.0], rtol=0.1)  # 2.5 ps of samples
    np.testing.assert_allclose(dyn.temp, units.kB * np.array([40.0, 160.0]))
    with pytest.raises(ValueError, match="temperature_K"):
        dyn.set_temperature(temperature_K=-5.0)
    np.testing.assert_allclose(dyn.temp, units.kB * np.array([40.0, 160.0]))


def test_langevin_attributes_match_ases(lj_calc64):
    atoms = _structures()[0]
    ours = Langevin(atoms, DT, T0, 0.01 / units.fs, seed=1, model=lj_calc64.model)
    reference = atoms.copy()
    reference.calc = lj_calc64
    theirs = AseLangevin(
        reference, DT, temperature_K=T0, friction=0.01 / units.fs, fixcm=False
    )
    assert ours.temp == pytest.approx(theirs.temp, rel=1e-15)
    assert ours.fr == pytest.approx(theirs.fr, rel=1e-15)
    assert isinstance(ours.temp, float)


def test_andersen_setters(lj_calc64):
    images = _structures()
    dyn = Andersen(images, DT, T0, 0.05, fixcm=False, seed=4, model=lj_calc64.model)
    dyn.run(15)
    middle = [atoms.copy() for atoms in images]
    with pytest.raises(ValueError, match=r"andersen_prob for images\[1\]"):
        dyn.set_andersen_prob([0.0, 1.5])
    np.testing.assert_array_equal(dyn.andersen_prob, 0.05)  # unchanged
    dyn.set_andersen_prob(0.0)
    dyn.set_timestep(1.0 * units.fs)
    dyn.set_temperature(200.0)
    dyn.run(15)
    _assert_same(images, _verlet_reference(middle, lj_calc64.model, 1.0 * units.fs, 15))
    reference = middle[0].copy()
    reference.calc = lj_calc64
    theirs = AseAndersen(reference, DT, temperature_K=200.0, andersen_prob=0.0)
    np.testing.assert_allclose(dyn.temp, theirs.temp, rtol=1e-15)


def test_bussi_attributes_match_ases(lj_calc64):
    images = _structures()
    images[1].set_constraint(FixAtoms(indices=[0, 1, 2]))
    ours = Bussi(images, DT, [T0, 2 * T0], 50 * units.fs, seed=1, model=lj_calc64.model)
    for index, atoms in enumerate(images):
        reference = atoms.copy()
        reference.calc = lj_calc64
        theirs = AseBussi(reference, DT, temperature_K=[T0, 2 * T0][index], taut=50)
        assert ours.temp[index] == pytest.approx(theirs.temp, rel=1e-15)
        assert ours.ndof[index] == theirs.ndof
        assert ours.target_kinetic_energy[index] == pytest.approx(
            theirs.target_kinetic_energy, rel=1e-15
        )
