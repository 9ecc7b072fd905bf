"""Nernst–Einstein conductivity: a value computed by hand, then end to end."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units

from nvalchemi_ase.analysis import mean_squared_displacement
from nvalchemi_ase.analysis.conductivity import nernst_einstein_conductivity
from nvalchemi_ase.analysis.diffusion import DiffusionResult

ROUND_OFF = 1e-12  # relative: the same product in another order
SIGMAS = 3.0  # an estimate within three of its standard errors


def _result(by_element, errors=None, label="s"):
    errors = errors or dict.fromkeys(by_element, 0.0)
    empty = np.zeros(1)
    return DiffusionResult(
        method="msd",
        label=label,
        lag_fs=empty,
        curve=empty,
        curve_by_element={},
        diffusion=float(np.mean(list(by_element.values()))),
        diffusion_error=0.0,
        diffusion_by_element=by_element,
        diffusion_error_by_element=errors,
        window_fs=(0.0, 1.0),
        block_diffusion=empty,
        block_length=1,
    )


def _licl(count, box):
    symbols = ["Li", "Cl"] * (count // 2)
    positions = np.random.default_rng(0).uniform(0, box, (count, 3))
    return Atoms(symbols, positions=positions, cell=[box] * 3, pbc=True)


def test_value_computed_by_hand():
    # 32 Li+ and 32 Cl-, D = 1e-4 Å²/fs = 1e-9 m²/s each, V = 1000 Å³ = 1e-27 m³,
    # T = 1000 K: σ = e² (32 + 32) 1e-9 / (1e-27 k_B 1000)
    #   = (1.602176634e-19)² × 6.4e-8 / 1.380649e-47 = 118.9919218 S/m
    atoms = _licl(64, 10.0)
    result = nernst_einstein_conductivity(
        [_result({"Li": 1e-4, "Cl": 1e-4})], [atoms], {"Li": 1, "Cl": -1}, 1000.0
    )[0]
    assert result.conductivity == pytest.approx(118.9919218, rel=1e-9)
    assert result.conductivity_mS_cm == pytest.approx(1189.919218, rel=1e-9)
    assert result.contribution_by_element["Li"] == pytest.approx(118.9919218 / 2)
    assert result.counts == {"Cl": 32, "Li": 32}
    assert result.volume == pytest.approx(1000.0)


def test_each_structure_its_own_volume_temperature_and_charges():
    small, large = _licl(64, 10.0), _licl(128, 16.0)
    diffusion = [
        _result({"Li": 2e-4, "Cl": 1e-4}, {"Li": 3e-5, "Cl": 4e-5}),
        _result({"Li": 1e-4, "Cl": 5e-5}),
    ]
    charges = [{"Li": 1, "Cl": -1}, {"Li": 0.8, "Cl": -0.8}]
    results = nernst_einstein_conductivity(
        diffusion, [small, large], charges, [1000.0, 600.0]
    )
    one = nernst_einstein_conductivity(
        diffusion[1:], [large], charges[1], 600.0, volume=16.0**3
    )[0]
    assert results[1].conductivity == pytest.approx(one.conductivity, rel=ROUND_OFF)
    # the first: contributions scale as N z² D; the error adds in quadrature
    unit = 118.9919218 / 64 / 1e-4  # S/m per (atom · e² · Å²/fs) at 1000 Å³, 1000 K
    assert results[0].conductivity == pytest.approx(unit * 32 * (2e-4 + 1e-4), rel=1e-9)
    expected_error = unit * 32 * np.hypot(3e-5, 4e-5)
    assert results[0].conductivity_error == pytest.approx(expected_error, rel=1e-9)
    scale = (0.8**2 / 1.0) * (10.0**3 / 16.0**3) * (1000.0 / 600.0) * 2
    assert results[1].conductivity == pytest.approx(
        unit * 32 * (1e-4 + 5e-5) * scale, rel=1e-9
    )


def test_random_walks_of_two_species_give_their_conductivity():
    """Einstein D per element from frames, then σ: against the walks' exact D."""
    rng = np.random.default_rng(3)
    count, n_frames, step_fs, box = 200, 400, 4.0, 20.0
    sigma = np.where(np.arange(count) % 2 == 0, 0.06, 0.03)  # Li, Cl: Å per frame
    walk = np.cumsum(
        rng.normal(size=(n_frames, count, 3)) * sigma[None, :, None], axis=0
    )
    frames = []
    for position in walk:
        atoms = _licl(count, box)
        atoms.positions = position
        atoms.wrap()
        frames.append(atoms)
    diffusion = mean_squared_displacement(
        [frames], step_fs * units.fs, window=50, block_length=100, remove_drift=False
    )
    result = nernst_einstein_conductivity(
        diffusion, frames[:1], {"Li": 1, "Cl": -1}, 500.0
    )[0]
    exact = {"Li": 0.06**2 / (2 * step_fs), "Cl": 0.03**2 / (2 * step_fs)}
    reference = nernst_einstein_conductivity(
        [_result(exact)], frames[:1], {"Li": 1, "Cl": -1}, 500.0
    )[0]
    assert 0 < result.conductivity_error < 0.1 * reference.conductivity
    difference = abs(result.conductivity - reference.conductivity)
    assert difference < SIGMAS * result.conductivity_error


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"charges": {"Li": 1}}, r"structures\[0\] has Cl"),
        ({"temperature_K": [300.0, 0.0]}, r"temperature_K for structures\[1\]"),
        ({"charges": [{"Li": 1, "Cl": -1}]}, "one per structure"),
        ({"volume": -1.0}, r"volume for structures\[0\]"),
    ],
)
def test_bad_inputs_name_the_structure_and_the_field(kwargs, match):
    arguments = {"charges": {"Li": 1, "Cl": -1}, "temperature_K": 300.0} | kwargs
    diffusion = [_result({"Li": 1e-4, "Cl": 1e-4})] * 2
    with pytest.raises(ValueError, match=match):
        nernst_einstein_conductivity(
            diffusion, [_licl(8, 5.0), _licl(8, 5.0)], **arguments
        )
    molecule = Atoms("LiCl", positions=[[0, 0, 0], [2, 0, 0]])
    with pytest.raises(ValueError, match="volume="):
        nernst_einstein_conductivity(
            diffusion[:1], [molecule], {"Li": 1, "Cl": -1}, 300.0
        )
