"""The one-template path for a new integrator (ARCHITECTURE.md, "Adding an engine").

Two small engines written the way the recipe says, each checked against an
independent fact: a velocity-rescaling thermostat declared through
``state_parameters`` reaches its target exactly, and a position-and-cell
scaling step in ``after_drift`` reaches the user's ``Atoms`` as ASE's strain.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch
from ase import units

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.engines._verlet import (
    CoupledThermostatVerlet,
    StateParameter,
    ThermostattedVerlet,
    degrees_of_freedom,
    kinetic_energy,
)
from nvalchemi_ase.units import temperature_K_to_nvalchemi
from nvalchemi_ase.wrap import md_class
from tests.structures import rattled_bulk, thermalize

TARGET_K = 40.0
# exact rescaling: only float64 round-off separates T from the target
RESCALED_T_RTOL = 1e-10
STRAIN_PER_STEP = 1e-3
CELL_ATOL = 1e-10  # Å


class Rescale(CoupledThermostatVerlet):
    """Scale velocities to the target temperature at every step (taut unused)."""

    state_parameters: ClassVar = (
        *CoupledThermostatVerlet.state_parameters,
        StateParameter("weight", "1", "weight", lambda value: value, minimum=0.0),
    )

    def after_second_kick(self, batch, free):
        energy = kinetic_energy(batch)
        thermal = 2.0 * energy / degrees_of_freedom(batch, free)
        scale = torch.sqrt(self._state.kT / thermal) ** self._state.weight
        batch.velocities.mul_(scale[batch.batch_idx.long()].unsqueeze(-1))


class Expanding(ThermostattedVerlet):
    """Velocity Verlet that strains every cell isotropically after the drift."""

    __needs_keys__: ClassVar[set[str]] = {"forces", "stress"}
    __provides_keys__: ClassVar[set[str]] = {"positions", "velocities", "cell"}

    def after_drift(self, batch, free):
        factor = 1.0 + STRAIN_PER_STEP
        batch.positions.mul_(factor)
        batch.cell.mul_(factor)


@pytest.fixture
def images(lj_calc64):
    structures = [
        thermalize(rattled_bulk(repeat=2, seed=s), 30.0 + 20.0 * s, seed=s)
        for s in (1, 2)
    ]
    for atoms in structures:
        atoms.calc = lj_calc64
    return structures


def test_declared_state_parameters_reach_the_engine(images):
    ASERescale = md_class(Rescale, timestep_unit="fs")
    # engines take kelvin with nvalchemi's kB; ASE's get_temperature uses ASE's
    target = float(temperature_K_to_nvalchemi(np.array([TARGET_K]))[0])
    dyn = ASERescale(
        images,
        1.0 * units.fs,
        engine_options={"temperature": target, "taut": 10.0, "weight": 1.0},
    )
    dyn.run(3)
    for atoms in images:
        assert atoms.get_temperature() == pytest.approx(TARGET_K, rel=RESCALED_T_RTOL)
    with pytest.raises(TypeError, match="weight"):
        ASERescale(
            images,
            1.0 * units.fs,
            engine_options={"temperature": TARGET_K, "taut": 10.0},
        )


def test_after_drift_moves_cells_that_come_back_to_the_atoms(images):
    cells = [atoms.cell.array.copy() for atoms in images]
    dyn = md_class(Expanding, timestep_unit="fs")(images, 1.0 * units.fs)
    assert dyn._guard.variable_cell  # the engine reads stress: cells move
    dyn.run(5)
    for atoms, cell in zip(images, cells, strict=True):
        expected = cell * (1.0 + STRAIN_PER_STEP) ** 5
        np.testing.assert_allclose(atoms.cell.array, expected, atol=CELL_ATOL, rtol=0)
    reference = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    copy = images[0].copy()
    copy.calc = reference
    np.testing.assert_allclose(
        images[0].get_forces(), copy.get_forces(), atol=1e-10, rtol=0
    )
