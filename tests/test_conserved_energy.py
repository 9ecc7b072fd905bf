"""``NoseHooverChainNVT.get_conserved_energy`` against ASE's and against itself.

ASE's ``NoseHooverChainNVT.get_conserved_energy`` is ``E_pot + E_kin`` plus the
chain energy; the exact dynamics keeps it constant, so ours and ASE's (two
different integrators of the same equations from the same start) must both
stay at their common starting value, while ``E_pot + E_kin`` itself moves by
the heat the thermostat exchanges. A second-order integrator's error shrinks
4× when the time step halves.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import units
from ase.md.nose_hoover_chain import NoseHooverChainNVT as AseNoseHooverChainNVT

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.md import NoseHooverChainNVT
from tests.structures import rattled_bulk, thermalize

T_START, T_TARGET = 20.0, 100.0  # K: the thermostat heats, E_pot + E_kin rises
TDAMP = 50 * units.fs
# Conserved energy stays within this fraction of E_pot + E_kin's excursion
# (measured: 1.8e-4 and 2.2e-4 at 2 fs over 1 ps, 32 and 64 atoms).
CONSERVED_FRACTION = 1e-3
# Ours and ASE's after 0.5 ps agree to this, eV (measured 6.6e-5 eV).
AGREEMENT_EV = 5e-4
SECOND_ORDER_MIN_RATIO = 3.0  # error ratio when dt halves (measured 4.0)


def _structures():
    small = thermalize(rattled_bulk(repeat=2, seed=1), T_START, seed=5)
    large = thermalize(rattled_bulk(repeat=2, seed=2).repeat((1, 1, 2)), T_START, 6)
    return [small, large]


def _record(dyn, steps, interval):
    conserved, total = [], []

    def sample():
        conserved.append(dyn.get_conserved_energy())
        thermo = dyn.per_structure_thermo()
        total.append(thermo["epot"] + thermo["ekin"])

    dyn.attach(sample, interval=interval)
    dyn.run(steps)
    return np.array(conserved), np.array(total)


@pytest.mark.slow
def test_conserved_energy_is_conserved_while_the_thermostat_heats(smooth_lj):
    images = _structures()
    dyn = NoseHooverChainNVT(
        images, 2 * units.fs, T_TARGET, TDAMP, model=smooth_lj.model
    )
    conserved, total = _record(dyn, 500, 10)
    excursion = np.ptp(total, axis=0)
    assert (excursion > 0.5).all()  # the thermostat did exchange heat (eV)
    drift = np.ptp(conserved, axis=0)
    assert (drift < CONSERVED_FRACTION * excursion).all()


@pytest.mark.slow
def test_it_equals_ases_conserved_energy_of_the_same_start(smooth_lj):
    start = _structures()[0]
    atoms, reference = start.copy(), start.copy()
    dyn = NoseHooverChainNVT(
        atoms, 2 * units.fs, T_TARGET, TDAMP, model=smooth_lj.model
    )
    reference.calc = NVAlchemiCalculator(smooth_lj.model, device="cpu", dtype="float64")
    ase_dyn = AseNoseHooverChainNVT(
        reference, 2 * units.fs, temperature_K=T_TARGET, tdamp=TDAMP
    )
    initial = dyn.get_conserved_energy()
    assert isinstance(initial, float)  # one Atoms in, one number out (as ASE)
    assert initial == pytest.approx(ase_dyn.get_conserved_energy(), abs=1e-10)
    dyn.run(250)
    ase_dyn.run(250)
    assert abs(reference.get_temperature() - T_START) > 30  # both were heated
    assert dyn.get_conserved_energy() == pytest.approx(
        ase_dyn.get_conserved_energy(), abs=AGREEMENT_EV
    )


@pytest.mark.slow
def test_its_error_is_second_order_in_the_time_step(smooth_lj):
    errors = []
    for dt_fs in (2.0, 1.0):
        dyn = NoseHooverChainNVT(
            _structures(), dt_fs * units.fs, T_TARGET, TDAMP, model=smooth_lj.model
        )
        conserved, _ = _record(dyn, int(500 * 2 / dt_fs), int(10 * 2 / dt_fs))
        errors.append(np.ptp(conserved, axis=0))
    assert (errors[0] / errors[1] > SECOND_ORDER_MIN_RATIO).all()
