"""D3 by name, offline, against s-dftd3 (the ``dftd3`` package, test-only)."""

import socket
import tomllib
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk, fcc111, molecule

pytest.importorskip("tad_dftd3", reason="extra d3 (tad-dftd3) not installed")
dftd3_ase = pytest.importorskip("dftd3.ase", reason="dftd3 (s-dftd3) not installed")

from nvalchemi_ase import NVAlchemiCalculator  # noqa: E402
from nvalchemi_ase.convert import StructureError  # noqa: E402
from nvalchemi_ase.models import dispersion, load_model  # noqa: E402

# nvalchemiops' D3 kernel returns float32 energies and forces whatever the input
# dtype: agreement is at float32 round-off (eps 1.2e-7) of the summed terms.
D3_ENERGY_RTOL = 1e-6
D3_ENERGY_ATOL = 1e-8  # eV
D3_FORCE_ATOL = 1e-6  # eV/Å
D3_STRESS_ATOL = 1e-7  # eV/Å³
# Measured here: benzene 1.3e-8 eV, ethanol 9e-9 eV, Si8 6e-7 eV of -2.47 eV.

CUTOFF = 12.0  # Å: one cutoff for pairs and CNs, in both codes


def _structures():
    slab = fcc111("Cu", (2, 2, 3), vacuum=6.0)  # periodic in x, y only
    return [
        molecule("C6H6"),
        molecule("CH3CH2OH"),
        molecule("CH3Cl"),
        slab,
        bulk("Si", "diamond", 5.43, cubic=True),
        bulk("NaCl", "rocksalt", 5.64, cubic=True),
        bulk("CsI", "cesiumchloride", 4.57),
        bulk("Au", "fcc", 4.08),
    ]


def _reference(atoms, params):
    calc = dftd3_ase.DFTD3(
        damping="d3bj",
        params_tweaks={**params, "s9": 0.0},  # nvalchemiops has no three-body term
        realspace_cutoff={"disp2": CUTOFF, "cn": CUTOFF},
    )
    atoms = atoms.copy()
    atoms.calc = calc
    result = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if atoms.pbc.all():
        result["stress"] = atoms.get_stress()
    return result


@pytest.fixture(scope="module")
def pbe_d3():
    return load_model("d3", functional="pbe", cutoff=CUTOFF, smoothing_fraction=0.0)


def test_d3_matches_s_dftd3_on_a_mixed_batch(pbe_d3):
    structures = _structures()
    params = dispersion.d3_parameters("pbe", "bj")
    calc = NVAlchemiCalculator(pbe_d3, device="cpu", dtype="float64")
    ours = calc.calculate_batch(structures, ["energy", "forces", "stress"])
    for atoms, mine in zip(structures, ours, strict=True):
        ref = _reference(atoms, params)
        name = atoms.get_chemical_formula()
        assert mine["energy"] == pytest.approx(
            ref["energy"], rel=D3_ENERGY_RTOL, abs=D3_ENERGY_ATOL
        ), name
        np.testing.assert_allclose(
            mine["forces"], ref["forces"], rtol=0, atol=D3_FORCE_ATOL, err_msg=name
        )
        if "stress" in ref:
            np.testing.assert_allclose(
                mine["stress"], ref["stress"], rtol=0, atol=D3_STRESS_ATOL, err_msg=name
            )
        assert ref["energy"] < 0


@pytest.mark.parametrize("functional", ["b3lyp", "r2scan", "pbe0"])
def test_functional_parameters_by_name_match_s_dftd3_s_own_choice(functional):
    """s-dftd3 picks the parameters from its own table by method name."""
    from ase.units import Bohr, Hartree
    from dftd3.interface import DispersionModel, RationalDampingParam

    atoms = molecule("CH3CH2OH")
    model = load_model("d3", functional=functional, cutoff=CUTOFF, smoothing_fraction=0)
    atoms.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    reference = DispersionModel(atoms.numbers, atoms.positions / Bohr)
    reference.set_realspace_cutoff(CUTOFF / Bohr, CUTOFF / Bohr, CUTOFF / Bohr)
    param = RationalDampingParam(method=functional, atm=False)
    expected = reference.get_dispersion(param, grad=False)["energy"] * Hartree
    assert atoms.get_potential_energy() == pytest.approx(
        expected, rel=D3_ENERGY_RTOL, abs=D3_ENERGY_ATOL
    )


def test_parameter_table_is_s_dftd3_s():
    """Every D3(BJ) entry equals the table the dftd3 wheel ships itself."""
    shipped = Path(next(iter(find_spec("dftd3").submodule_search_locations)))
    with open(shipped / "parameters.toml", "rb") as handle:
        table = tomllib.load(handle)
    defaults = table["default"]["parameter"]["d3"]["bj"]
    names = dispersion.d3_functionals("bj")
    assert len(names) > 100
    for name in names:
        expected = {**defaults, **table["parameter"][name]["d3"]["bj"]}
        got = dispersion.d3_parameters(name, "bj")
        assert got == {k: pytest.approx(float(expected[k])) for k in got}, name


def test_aliases_and_case_resolve():
    assert dispersion.d3_parameters("B3-LYP") == dispersion.d3_parameters("b3lyp5")
    assert dispersion.d3_parameters("PBE")["a1"] == pytest.approx(0.4289)


def test_zero_damping_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="only rational"):
        load_model("d3", damping="zero")


def test_unknown_functional_suggests_close_names():
    with pytest.raises(ValueError, match=r"did you mean.*b3lyp"):
        load_model("d3", functional="b3lip")


def test_elements_outside_the_tables_are_refused_before_any_work(pbe_d3):
    counts = dispersion._reference_counts()
    assert {z for z in range(1, 95) if counts[z] <= 5} == dispersion.D3_ELEMENTS
    uranium = bulk("U", "fcc", 4.3)
    calc = NVAlchemiCalculator(pbe_d3, device="cpu", dtype="float64")
    with pytest.raises(StructureError, match="U"):
        calc.calculate_batch([molecule("H2O"), uranium], ["energy"])


def test_d3_loads_and_evaluates_without_network(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("network used")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("NVALCHEMI_ASE_WEIGHTS", str(tmp_path))  # build the file anew
    atoms = bulk("Si", "diamond", 5.43)
    atoms.calc = NVAlchemiCalculator("d3", device="cpu")
    assert atoms.get_potential_energy() < 0
    assert list((tmp_path / "d3").glob("dftd3-*.pt"))
