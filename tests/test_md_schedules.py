"""Temperature and pressure schedules on every thermostat and barostat class.

References: the class run with a constant number (a constant schedule is the
same run, bit for bit), ASE's own setter called between runs (``Langevin``,
``Andersen``), ASE's ``NVTBerendsen`` with ``set_temperature`` called from an
observer, an uninterrupted run (restart continues the schedule exactly), and
the canonical mean temperature at the end of a heating ramp.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from ase import units
from ase.md.nvtberendsen import NVTBerendsen as AseNVTBerendsen

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.dynamics.checkpoint import CheckpointError
from nvalchemi_ase.dynamics.logs import internal
from nvalchemi_ase.md import (
    MTKNPT,
    NPH,
    Andersen,
    Bussi,
    IsotropicMTKNPT,
    Langevin,
    LangevinBAOAB,
    NoseHooverChainNVT,
    NVTBerendsen,
    VelocityVerlet,
)
from nvalchemi_ase.md import schedules as schedules_module
from nvalchemi_ase.md.schedules import Schedule, piecewise_linear
from tests.structures import cluster, rattled_bulk, thermalize, triclinic

DT = 5 * units.fs
HALF = 20  # steps per half of a restarted run
BERENDSEN_VELOCITY_TOL = 1e-10  # Å/ASE-time over 60 steps (velocities ~5e-2)
RAMP_MEAN_RTOL = 0.05  # mean T over the hold within 5 % (~4 standard errors)
GPA = units.GPa

# a ramp over the whole restarted run, so every step has its own target
HEAT = [(0, 300.0), (2 * HALF, 600.0)]
SQUEEZE = [(0, 0.0), (2 * HALF, 0.5 * GPA)]


def _structures(calc, *, bulk_only=False):
    """2-3 structures of different sizes (32, 4 and 55 atoms), thermalised."""
    images = [thermalize(rattled_bulk(2), 300.0, 0), thermalize(triclinic(), 300.0, 1)]
    if not bulk_only:
        images.append(thermalize(cluster(), 300.0, 2))
    for atoms in images:
        atoms.calc = calc
    return images


def _npt(temperature, pressure):
    return {
        "temperature_K": temperature,
        "pressure_au": pressure,
        "tdamp": 100 * units.fs,
        "pdamp": 1000 * units.fs,
    }


# name -> factory(calc, temperature, pressure, **kwargs)
CLASSES = {
    "Langevin": lambda c, t, p, **k: Langevin(
        _structures(c), DT, temperature_K=t, friction=0.01 / units.fs, seed=1, **k
    ),
    "LangevinBAOAB": lambda c, t, p, **k: LangevinBAOAB(
        _structures(c), DT, temperature_K=t, T_tau=50 * DT, seed=4, **k
    ),
    "LangevinBAOAB-NPT": lambda c, t, p, **k: LangevinBAOAB(
        _structures(c, bulk_only=True),
        DT,
        temperature_K=t,
        T_tau=50 * DT,
        externalstress=p,
        P_tau=1000 * units.fs,
        P_mass=1e4,
        seed=4,
        **k,
    ),
    "NoseHooverChainNVT": lambda c, t, p, **k: NoseHooverChainNVT(
        _structures(c), DT, temperature_K=t, tdamp=100 * units.fs, **k
    ),
    "IsotropicMTKNPT": lambda c, t, p, **k: IsotropicMTKNPT(
        _structures(c, bulk_only=True), DT, **_npt(t, p), **k
    ),
    "MTKNPT": lambda c, t, p, **k: MTKNPT(
        _structures(c, bulk_only=True), DT, **_npt(t, p), **k
    ),
    "NPH": lambda c, t, p, **k: NPH(
        _structures(c, bulk_only=True),
        DT,
        pressure_au=p,
        pdamp=1000 * units.fs,
        pressure_coupling="triclinic",
        **k,
    ),
    "Bussi": lambda c, t, p, **k: Bussi(
        _structures(c), DT, temperature_K=t, taut=100 * units.fs, seed=1, **k
    ),
    "NVTBerendsen": lambda c, t, p, **k: NVTBerendsen(
        _structures(c), DT, temperature_K=t, taut=100 * units.fs, **k
    ),
    "Andersen": lambda c, t, p, **k: Andersen(
        _structures(c), DT, temperature_K=t, andersen_prob=0.05, seed=1, **k
    ),
}


def _run(dyn, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        dyn.run(steps)


def _make(name, calc, temperature, pressure, **kwargs):
    with warnings.catch_warnings():  # LangevinBAOAB's default-argument warnings
        warnings.simplefilter("ignore", UserWarning)
        return CLASSES[name](calc, temperature, pressure, **kwargs)


def _assert_same_state(expected, actual):
    assert actual.nsteps == expected.nsteps
    for reference, atoms in zip(expected.images, actual.images, strict=True):
        np.testing.assert_array_equal(atoms.positions, reference.positions)
        np.testing.assert_array_equal(atoms.get_momenta(), reference.get_momenta())
        np.testing.assert_array_equal(atoms.cell.array, reference.cell.array)


def _pressure_for(name, value):
    """LangevinBAOAB holds a stress (negative compresses), the others a pressure."""
    if name.startswith("LangevinBAOAB"):
        if isinstance(value, list):
            return [(step, -pressure) for step, pressure in value]
        return -value
    return value


@pytest.mark.parametrize("name", list(CLASSES))
def test_constant_schedule_is_the_constant_run(name, lj_calc64):
    """The hook writes the target in the engine's units: no change, bit for bit."""
    number = _make(name, lj_calc64, 300.0, _pressure_for(name, 0.1 * GPA))
    _run(number, HALF)
    scheduled = _make(
        name,
        lj_calc64,
        lambda step: 300.0,
        _pressure_for(name, [(0, 0.1 * GPA), (HALF, 0.1 * GPA)]),
    )
    _run(scheduled, HALF)
    _assert_same_state(number, scheduled)


@pytest.mark.parametrize("name", list(CLASSES))
def test_restart_continues_the_schedule_bit_for_bit(
    name, tmp_path, lj_calc64, monkeypatch
):
    # blocks of 7 steps: the restart starts inside a block of the first run
    monkeypatch.setattr(schedules_module, "BLOCK_STEPS", 7)
    pressure = _pressure_for(name, SQUEEZE)
    reference = _make(name, lj_calc64, HEAT, pressure)
    _run(reference, 2 * HALF)
    path = tmp_path / "restart.npz"
    first = _make(name, lj_calc64, HEAT, pressure, restart=path)
    _run(first, HALF)
    second = _make(name, lj_calc64, HEAT, pressure, restart=path)
    _run(second, HALF)
    _assert_same_state(reference, second)
    # and the schedule did act: a constant target ends elsewhere
    constant = _make(name, lj_calc64, 300.0, _pressure_for(name, 0.0))
    _run(constant, 2 * HALF)
    assert not np.array_equal(constant.images[0].positions, second.images[0].positions)


def test_restart_with_another_schedule_is_refused(tmp_path, lj_calc64):
    path = tmp_path / "restart.npz"
    _run(_make("Bussi", lj_calc64, HEAT, None, restart=path), 3)
    other = [(0, 300.0), (2 * HALF, 900.0)]
    with pytest.raises(CheckpointError, match="parameters"):
        _make("Bussi", lj_calc64, other, None, restart=path)


@pytest.mark.parametrize("name", ["Langevin", "Andersen"])
def test_a_step_in_the_schedule_equals_ases_setter_between_runs(name, lj_calc64):
    switch = 7
    schedule = [(0, 300.0), (switch - 1, 300.0), (switch, 700.0)]
    scheduled = _make(name, lj_calc64, schedule, None)
    _run(scheduled, 2 * switch)
    by_setter = _make(name, lj_calc64, 300.0, None)
    _run(by_setter, switch)
    by_setter.set_temperature(temperature_K=700.0)
    _run(by_setter, switch)
    _assert_same_state(by_setter, scheduled)


def test_nvtberendsen_ramp_matches_ase_with_set_temperature_observer(lj_calc64):
    start = thermalize(rattled_bulk(repeat=2, seed=1), 60.0, seed=3)
    atoms, reference = start.copy(), start.copy()
    atoms.calc = lj_calc64
    reference.calc = NVAlchemiCalculator(lj_calc64.model, device="cpu", dtype="float64")
    ramp = piecewise_linear([(0, 60.0), (40, 160.0)])
    ours, theirs = [], []
    dyn = NVTBerendsen(atoms, 2 * units.fs, ramp, 20 * units.fs, fixcm=False)
    dyn.attach(lambda: ours.append(atoms.get_velocities()))
    dyn.run(60)
    ase_dyn = AseNVTBerendsen(
        reference, 2 * units.fs, temperature_K=60.0, taut=20 * units.fs, fixcm=False
    )
    # ASE: the observer after step n sets the target of step n -> n + 1
    ase_dyn.attach(
        lambda: ase_dyn.set_temperature(temperature_K=float(ramp(ase_dyn.nsteps)))
    )
    ase_dyn.attach(lambda: theirs.append(reference.get_velocities()))
    ase_dyn.run(60)
    assert len(ours) == len(theirs) == 61
    difference = max(np.abs(a - b).max() for a, b in zip(ours, theirs, strict=True))
    assert difference < BERENDSEN_VELOCITY_TOL
    assert atoms.get_temperature() > 120.0  # the ramp did heat it


def test_shared_schedule_equals_the_same_values_per_structure(lj_calc64):
    shared = _make("Bussi", lj_calc64, HEAT, None)
    _run(shared, HALF)
    count = len(shared.images)
    per_structure = [(step, [value] * count) for step, value in HEAT]
    each = _make("Bussi", lj_calc64, per_structure, None)
    _run(each, HALF)
    _assert_same_state(shared, each)
    callable_form = _make(
        "Bussi", lj_calc64, lambda n: np.full(count, 300.0 + 7.5 * n), None
    )
    _run(callable_form, HALF)
    _assert_same_state(shared, callable_form)


def _heated(calc, targets, steps, hold_from):
    images = [
        thermalize(rattled_bulk(repeat=3, seed=20 + i), 10.0, seed=50 + i)
        for i in range(len(targets))
    ]
    for atoms in images:
        atoms.calc = calc
    ramp = [(0, [10.0] * len(targets)), (hold_from // 2, list(targets))]
    dyn = Langevin(images, DT, temperature_K=ramp, friction=0.02 / units.fs, seed=3)
    samples = []
    dyn.attach(
        internal(lambda: samples.append(dyn.per_structure_thermo()["temperature"]))
    )
    dyn.run(steps)
    return np.array(samples[hold_from + 1 :]), dyn


@pytest.mark.slow
def test_heating_ramp_reaches_each_structures_target_mean_temperature(lj_calc64):
    targets = [40.0, 70.0]  # K, solid LJ argon; one per structure
    samples, dyn = _heated(lj_calc64, targets, steps=800, hold_from=300)
    np.testing.assert_allclose(samples.mean(axis=0), targets, rtol=RAMP_MEAN_RTOL)
    np.testing.assert_allclose(dyn.temp, units.kB * np.array(targets))


def test_attributes_and_todict_follow_the_schedule(lj_calc64):
    dyn = _make("Langevin", lj_calc64, HEAT, None)
    assert dyn.temperature_K == pytest.approx(300.0)
    _run(dyn, 10)
    assert dyn.temperature_K == pytest.approx(375.0)
    assert dyn.todict()["temperature_K"] == {
        "schedule": "piecewise-linear",
        "steps": [0, 2 * HALF],
        "values": [300.0, 600.0],
    }
    assert set(dyn.schedules) == {"temperature_K"}
    dyn.set_temperature(temperature_K=250.0)  # a number ends the schedule
    _run(dyn, 2)
    assert dyn.temperature_K == 250.0
    assert dyn.schedules == {}
    assert "schedule" not in str(dyn.todict()["temperature_K"])


def test_piecewise_linear_interpolates_and_holds_the_ends():
    schedule = piecewise_linear([(10, 100.0), (20, [200.0, 400.0])])
    np.testing.assert_allclose(
        schedule.values(np.array([0, 10, 15, 20, 99])),
        [[100, 100], [100, 100], [150, 250], [200, 400], [200, 400]],
    )
    assert repr(Schedule(np.cos)).startswith("Schedule(numpy")


@pytest.mark.parametrize(
    ("schedule", "error", "match"),
    [
        ([(0, 300.0), (0, 400.0)], ValueError, "increase"),
        ([(-1, 300.0), (5, 400.0)], ValueError, "integers >= 0"),
        ([(0, 300.0), (5, [1.0, 2.0, 3.0])], ValueError, "one per structure"),
        (lambda n: 300.0 - 100.0 * n, ValueError, r"images\[0\] at step 4"),
        (lambda n: [300.0, np.nan], ValueError, r"images\[1\]"),
        (lambda n: "300", TypeError, "give a number"),
    ],
)
def test_bad_schedules_are_refused_naming_step_and_structure(
    schedule, error, match, lj_calc64
):
    images = [thermalize(rattled_bulk(2), 300.0, seed) for seed in (0, 1)]
    for atoms in images:
        atoms.calc = lj_calc64
    with pytest.raises(error, match=match):
        Bussi(images, DT, temperature_K=schedule, taut=100 * units.fs).run(6)


def test_schedule_on_a_fixed_parameter_is_refused(lj_calc64):
    images = _structures(lj_calc64)
    with pytest.raises(TypeError, match="taut"):
        Bussi(images, DT, temperature_K=300.0, taut=lambda n: 100 * units.fs)
    with pytest.raises(AttributeError):
        VelocityVerlet(images, DT).temperature_K  # noqa: B018


def test_relax_then_scheduled_md_is_refused(lj_calc64):
    """Each structure enters its MD at another step: a step schedule is ambiguous."""
    from nvalchemi_ase.optimize import FIRE2

    images = _structures(lj_calc64)
    md = Langevin(images, DT, temperature_K=HEAT, friction=0.01 / units.fs)
    with pytest.raises(ValueError, match="relax first"):
        FIRE2(images, logfile=None) + md
