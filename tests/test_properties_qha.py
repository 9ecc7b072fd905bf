"""Batched quasi-harmonic approximation vs phonopy driven one cell at a time.

The reference scales the same relaxed cell, evaluates every static energy
and every displaced supercell's forces through the calculator one
``Atoms`` at a time, and runs :func:`phonopy.run_qha` itself. Lennard-Jones
argon with a smooth cutoff (a hard cutoff crossed by a neighbour shell under
strain gives imaginary modes: the check below).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase import Atoms, units
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.models import load_model
from tests.helpers import assert_same_snapshot, snapshot
from tests.structures import A_AR

pytest.importorskip("phonopy")

from nvalchemi_ase.properties import qha

# Same float64 forces and energies to ~1e-13 on both sides: the fits agree
# to round-off.
QHA_RTOL = 1e-7
TEMPERATURES = np.arange(0.0, 61.0, 10.0)
SUPERCELL = (2, 2, 2)
MESH = (5, 5, 5)  # odd: Γ-centred (an even mesh is shifted, phonopy warns)
N_VOLUMES = 5
STRAIN = 0.05
HCP_A = 3.72


def _materials() -> list[Atoms]:
    return [
        bulk("Ar", "fcc", a=A_AR),  # 1 atom
        bulk("Ar", "hcp", a=HCP_A, c=HCP_A * np.sqrt(8.0 / 3.0)),  # 2 atoms
    ]


@pytest.fixture(scope="module")
def smooth_lj():
    model = load_model("lj", cutoff=9.0, switch_width=2.0)
    return NVAlchemiCalculator(model, device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def batched(smooth_lj):
    materials = _materials()
    before = [snapshot(atoms) for atoms in materials]
    results = qha(
        materials,
        smooth_lj,
        n_volumes=N_VOLUMES,
        strain=STRAIN,
        supercell=SUPERCELL,
        mesh=MESH,
        temperatures=TEMPERATURES,
    )
    return materials, before, results


def _sequential(calc, atoms, cell):
    """phonopy's QHA with every energy and force from one ``Atoms`` at a time."""
    from phonopy import Phonopy, run_qha
    from phonopy.structure.atoms import PhonopyAtoms
    from phonopy.structure.cells import guess_primitive_matrix

    reference = atoms.copy()
    reference.set_cell(cell, scale_atoms=True)
    phonopys, energies, volumes = [], [], []
    for factor in np.linspace(1 - STRAIN, 1 + STRAIN, N_VOLUMES):
        scaled = reference.copy()
        scaled.set_cell(reference.cell.array * factor, scale_atoms=True)
        scaled.calc = calc
        energies.append(scaled.get_potential_energy())
        volumes.append(scaled.get_volume())
        unitcell = PhonopyAtoms(
            symbols=scaled.get_chemical_symbols(),
            cell=scaled.cell.array,
            scaled_positions=scaled.get_scaled_positions(wrap=False),
            masses=scaled.get_masses(),
        )
        phonon = Phonopy(
            unitcell,
            supercell_matrix=np.diag(SUPERCELL),
            primitive_matrix=guess_primitive_matrix(unitcell, symprec=1e-5),
        )
        phonon.generate_displacements(distance=0.01)
        forces = []
        for sc in phonon.supercells_with_displacements:
            displaced = Atoms(
                sc.symbols, cell=sc.cell, scaled_positions=sc.scaled_positions, pbc=True
            )
            displaced.calc = calc
            forces.append(displaced.get_forces())
        phonon.forces = np.array(forces)
        phonon.produce_force_constants()
        phonopys.append(phonon)
    cells = len(atoms) // len(phonopys[0].primitive)
    fit = run_qha(
        phonopys,
        TEMPERATURES,
        internal_energies=np.array(energies) / cells,
        mesh=MESH,
        eos="vinet",
        exclude_gamma_acoustic=True,
    )
    return fit, cells, np.array(volumes), np.array(energies)


def test_qha_matches_sequential_phonopy(batched, smooth_lj):
    materials, before, results = batched
    for atoms, seen, result in zip(materials, before, results, strict=True):
        assert result.ok, result.error
        assert_same_snapshot(seen, atoms)
        fit, cells, volumes, energies = _sequential(smooth_lj, atoms, result.cell)
        assert result.n_primitive_cells == cells
        np.testing.assert_allclose(result.volumes, volumes, rtol=1e-12)
        np.testing.assert_allclose(result.energies, energies, rtol=1e-10)
        np.testing.assert_allclose(result.temperatures, fit.temperatures)
        pairs = [
            (result.volume_temperature, fit.equilibrium_volumes * cells),
            (result.thermal_expansion, fit.thermal_expansion),
            (result.bulk_modulus_temperature, fit.bulk_moduli / units.GPa),
            (result.gibbs_temperature, fit.gibbs_free_energies * cells),
            (result.helmholtz_volume, fit.helmholtz_volume * cells),
            (result.heat_capacity_P, fit.heat_capacity_P.heat_capacities * cells),
        ]
        for ours, theirs in pairs:
            np.testing.assert_allclose(ours, theirs, rtol=QHA_RTOL, atol=1e-14)


def test_qha_physics(batched):
    _, _, (fcc, hcp) = batched
    for result in (fcc, hcp):
        assert result.temperatures.shape == (len(TEMPERATURES) - 1,)
        # V(T) rises, B(T) falls, α > 0 above 0 K; G falls with T
        assert (np.diff(result.volume_temperature) > 0).all()
        assert (np.diff(result.bulk_modulus_temperature) < 0).all()
        assert (result.thermal_expansion[1:] > 0).all()
        assert (np.diff(result.gibbs_temperature) < 0).all()
        np.testing.assert_allclose(
            result.linear_thermal_expansion, result.thermal_expansion / 3
        )
        # the sampled volumes bracket V(T) (no extrapolation)
        assert result.volumes.min() < result.volume_temperature.min()
        assert result.volume_temperature.max() < result.volumes.max()
    # fcc and hcp argon: nearly the same volume per atom and expansion
    per_atom = hcp.volume_temperature / 2 / fcc.volume_temperature
    np.testing.assert_allclose(per_atom, 1.0, atol=0.01)


def test_all_displaced_supercells_of_all_volumes_in_one_call(smooth_lj, monkeypatch):
    calls = []
    original = smooth_lj.calculate_batch

    def counting(images, properties=("energy", "forces")):
        calls.append(len(images))
        return original(images, properties)

    monkeypatch.setattr(smooth_lj, "calculate_batch", counting)
    results = qha(
        _materials(),
        smooth_lj,
        n_volumes=N_VOLUMES,
        strain=STRAIN,
        supercell=SUPERCELL,
        mesh=(3, 3, 3),
        temperatures=TEMPERATURES,
        relax_first=False,
        relax=None,
    )
    assert all(r.ok for r in results), [r.error for r in results]
    # one call for the static energies, one for every displaced supercell
    assert calls == [2 * N_VOLUMES, sum(int(r.n_displacements.sum()) for r in results)]


@pytest.mark.slow  # ~4 CPU-s: among test-fast's costliest
def test_imaginary_modes_fail_their_material_only(lj_calc64):
    # hard-cutoff LJ: at +2 % of the relaxed fcc cell the fifth neighbour
    # shell sits 0.01 Å inside the 8.5 Å cutoff, which displacements cross
    fcc, hcp = qha(
        _materials(),
        lj_calc64,
        n_volumes=6,
        strain=0.02,
        supercell=(3, 3, 3),
        mesh=MESH,
        temperatures=TEMPERATURES[:3],
    )
    assert not fcc.ok
    assert "imaginary" in fcc.error
    assert "volume 6/6" in fcc.error
    assert fcc.min_frequencies[-1] < -0.05  # kept, reported
    assert hcp.ok, hcp.error


def test_results_serialise_to_strict_json_with_units(batched):
    _, _, results = batched
    data = json.loads(json.dumps(results[0].to_dict(), allow_nan=False))
    assert data["units"]["thermal_expansion"] == "1/K"
    assert "qha" not in data
    assert "phonopys" not in data


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_volumes": 4}, "n_volumes"),
        ({"strain": 0.0}, "strain"),
        ({"temperatures": (0.0, 10.0)}, "temperatures"),
        ({"temperatures": (0.0, 20.0, 10.0)}, "ascending"),
        ({"eos": "birchmurnaghan"}, "eos"),
        ({"relax": "shape"}, "relax"),
        ({"displacement": -0.01}, "displacement"),
        ({"supercell": (2, 2)}, "supercell"),
        ({"imaginary_tolerance": 0.0}, "imaginary_tolerance"),
    ],
)
def test_invalid_arguments_are_refused_before_any_work(
    lj_calc64, monkeypatch, kwargs, match
):
    def no_calls(*args, **kwargs):
        raise AssertionError("the model was called")

    monkeypatch.setattr(lj_calc64, "calculate_batch", no_calls)
    with pytest.raises(ValueError, match=match):
        qha(_materials()[0], lj_calc64, **kwargs)
