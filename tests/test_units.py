import numpy as np
import pytest
from ase import units
from ase.stress import full_3x3_to_voigt_6_stress, voigt_6_to_full_3x3_stress

from nvalchemi_ase import units as nu


def test_time_constant_is_nvalchemis_own():
    from nvalchemi.dynamics._units import FS_PER_INTERNAL_TIME, KB_EV

    assert nu.FS_PER_ASE_TIME == FS_PER_INTERNAL_TIME
    assert nu.KB_EV_NVALCHEMI == KB_EV


def test_time_constant_agrees_with_ase_units():
    # nvalchemi's internal time unit is the ASE time unit (to ASE's 4e-9 precision)
    assert pytest.approx(1.0 / units.fs, rel=1e-8) == nu.FS_PER_ASE_TIME


def test_time_round_trip_and_friction_is_inverse_time():
    timestep = 2.0 * units.fs
    assert nu.fs_to_ase_time(nu.ase_time_to_fs(timestep)) == pytest.approx(
        timestep, rel=1e-15
    )
    assert nu.ase_time_to_fs(timestep) == pytest.approx(2.0, rel=1e-8)
    friction = 0.01 / units.fs  # ASE's docstring: 0.01 fs^-1
    assert nu.ase_rate_to_per_fs(friction) == pytest.approx(0.01, rel=1e-8)


def test_temperature_rescaling_preserves_kT():
    from nvalchemi.dynamics import KB_EV

    t_nv = nu.temperature_K_to_nvalchemi(300.0)
    assert KB_EV * t_nv == pytest.approx(units.kB * 300.0, rel=1e-15)
    assert nu.nvalchemi_temperature_to_K(t_nv) == pytest.approx(300.0, rel=1e-15)


def test_voigt_conversion_matches_ase():
    rng = np.random.default_rng(0)
    full = rng.normal(size=(5, 3, 3))
    full = full + full.transpose(0, 2, 1)
    expected = np.array([full_3x3_to_voigt_6_stress(s) for s in full])
    np.testing.assert_allclose(
        nu.stress_3x3_to_voigt(full), expected, rtol=0, atol=1e-15
    )
    back = nu.voigt_to_stress_3x3(expected)
    np.testing.assert_allclose(
        back, np.array([voigt_6_to_full_3x3_stress(v) for v in expected]), atol=1e-15
    )


def test_pressure_sign_is_compressive_positive():
    # hydrostatic compression: negative (compressive) tensile-positive stress
    assert nu.pressure_from_stress(np.array([-1.0, -1.0, -1.0, 0, 0, 0])) == 1.0


def test_momenta_velocities_round_trip():
    rng = np.random.default_rng(1)
    masses = rng.uniform(1, 200, size=7)
    momenta = rng.normal(size=(7, 3))
    velocities = nu.momenta_to_velocities(momenta, masses)
    np.testing.assert_allclose(
        nu.velocities_to_momenta(velocities, masses), momenta, rtol=1e-15
    )


def test_kinetic_temperature_matches_ase():
    from tests.structures import rattled_bulk, thermalize

    atoms = thermalize(rattled_bulk(repeat=2), 80.0, seed=2)
    expected = atoms.get_temperature()
    got = nu.kinetic_temperature_K(atoms.get_kinetic_energy(), 3 * len(atoms))
    assert got == pytest.approx(expected, rel=1e-14)
