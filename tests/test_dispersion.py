"""D3 by name, offline, against s-dftd3 (the ``dftd3`` package, test-only)."""

import copy
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


def test_other_dampings_are_refused_with_the_reason():
    for damping in ("zerom", "op", "cso"):
        with pytest.raises(ValueError, match="implemented are rational"):
            load_model("d3", damping=damping)


# -- zero damping (nvalchemi_ase.models.zero_damping) -------------------------------
# float64 throughout, against s-dftd3's float64 Fortran. Measured here: energies
# 1.5e-11 relative (Si8), forces 7e-13 eV/Å, stress 3e-14 eV/Å³; what is left
# is the order of summation and tad-dftd3's C6 table.
ZERO_ENERGY_RTOL = 1e-9
ZERO_ENERGY_ATOL = 1e-12  # eV
ZERO_FORCE_ATOL = 1e-9  # eV/Å
ZERO_STRESS_ATOL = 1e-10  # eV/Å³
# NVE with the default taper: spread of E_pot + E_kin over 40 fs at 1 fs, eV per
# atom (measured 4e-8 for a Cu slab, 1.6e-6 for benzene, whose free H atoms
# bounce off the zero-damped repulsive wall; a jump would be ~1e-3).
ZERO_NVE_SPREAD_PER_ATOM = 1e-5


def _rattled():
    structures = _structures()
    for index, atoms in enumerate(structures):
        atoms.rattle(0.03, seed=index)
    return structures


def _zero_reference(atoms, params):
    calc = dftd3_ase.DFTD3(
        damping="d3zero",
        params_tweaks={**params, "s9": 0.0},
        realspace_cutoff={"disp2": CUTOFF, "cn": CUTOFF},
    )
    atoms = atoms.copy()
    atoms.calc = calc
    result = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if atoms.pbc.all():
        result["stress"] = atoms.get_stress()
    return result


@pytest.fixture(scope="module")
def pbe_d3_zero():
    return load_model("d3-zero", functional="pbe", cutoff=CUTOFF, smoothing_fraction=0)


def test_d3_zero_matches_s_dftd3_on_a_mixed_batch(pbe_d3_zero):
    structures = _rattled()
    params = dispersion.d3_parameters("pbe", "zero")
    assert set(params) == {"s6", "s8", "rs6", "rs8", "alp"}
    calc = NVAlchemiCalculator(pbe_d3_zero, device="cpu", dtype="float64")
    ours = calc.calculate_batch(structures, ["energy", "forces", "stress"])
    for atoms, mine in zip(structures, ours, strict=True):
        ref = _zero_reference(atoms, params)
        name = atoms.get_chemical_formula()
        assert mine["energy"] == pytest.approx(
            ref["energy"], rel=ZERO_ENERGY_RTOL, abs=ZERO_ENERGY_ATOL
        ), name
        np.testing.assert_allclose(
            mine["forces"], ref["forces"], rtol=0, atol=ZERO_FORCE_ATOL, err_msg=name
        )
        if len(atoms) > 1:  # rattled: not trivially zero
            assert np.abs(ref["forces"]).max() > 1e-4, name
        if "stress" in ref:
            np.testing.assert_allclose(
                mine["stress"],
                ref["stress"],
                rtol=0,
                atol=ZERO_STRESS_ATOL,
                err_msg=name,
            )
            assert np.abs(ref["stress"]).max() > 1e-5, name
        # zero and BJ damping differ: the parameters and function were used
        bj = _reference(atoms, dispersion.d3_parameters("pbe", "bj"))["energy"]
        assert abs(mine["energy"] - bj) > 1e-4, name


def test_d3_zero_elements_beyond_the_bj_kernel(pbe_d3_zero):
    # uranium has 7 D3 reference systems: nvalchemi's 5-wide kernel refuses it,
    # tad-dftd3's references cover it
    uranium = bulk("U", "fcc", 4.3)
    uranium.rattle(0.02, seed=1)
    calc = NVAlchemiCalculator(pbe_d3_zero, device="cpu", dtype="float64")
    (mine,) = calc.calculate_batch([uranium], ["energy", "forces"])
    ref = _zero_reference(uranium, dispersion.d3_parameters("pbe", "zero"))
    assert mine["energy"] == pytest.approx(ref["energy"], rel=ZERO_ENERGY_RTOL)
    np.testing.assert_allclose(mine["forces"], ref["forces"], atol=ZERO_FORCE_ATOL)


@pytest.mark.parametrize("functional", ["b3lyp", "r2scan", "pbe0"])
def test_d3_zero_parameters_by_name_match_s_dftd3_s_own_choice(functional):
    from ase.units import Bohr, Hartree
    from dftd3.interface import DispersionModel, ZeroDampingParam

    if functional not in dispersion.d3_functionals("zero"):
        with pytest.raises(ValueError, match="no D3"):
            load_model("d3-zero", functional=functional)
        return
    atoms = molecule("CH3CH2OH")
    model = load_model("d3-zero", functional=functional, cutoff=CUTOFF)
    model.smoothing_fraction = 0.0
    atoms.calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    reference = DispersionModel(atoms.numbers, atoms.positions / Bohr)
    reference.set_realspace_cutoff(CUTOFF / Bohr, CUTOFF / Bohr, CUTOFF / Bohr)
    param = ZeroDampingParam(method=functional, atm=False)
    expected = reference.get_dispersion(param, grad=False)["energy"] * Hartree
    assert atoms.get_potential_energy() == pytest.approx(
        expected, rel=ZERO_ENERGY_RTOL, abs=ZERO_ENERGY_ATOL
    )


def test_zero_damping_parameter_table_is_s_dftd3_s():
    shipped = Path(next(iter(find_spec("dftd3").submodule_search_locations)))
    with open(shipped / "parameters.toml", "rb") as handle:
        table = tomllib.load(handle)
    defaults = table["default"]["parameter"]["d3"]["zero"]
    names = dispersion.d3_functionals("zero")
    assert len(names) > 50
    for name in names:
        # s-dftd3 takes s8 = 0 where an entry has none (cf22d)
        expected = {"s8": 0.0, **defaults, **table["parameter"][name]["d3"]["zero"]}
        got = dispersion.d3_parameters(name, "zero")
        assert got == {k: pytest.approx(float(expected[k])) for k in got}, name


def test_d3_zero_names_as_a_user_would_write_them():
    ethanol = molecule("CH3CH2OH")
    energies = []
    for name, params in (
        ("d3-zero", {}),
        ("d3zero", {}),
        ("d3-zero(pbe)", {}),
        ("d3(pbe, damping='zero')", {}),
        ("d3", {"damping": "zero"}),
        ("d3", {"functional": "PBE", "damping": "D3(zero)"}),
    ):
        atoms = ethanol.copy()
        atoms.calc = NVAlchemiCalculator(
            load_model(name, **params), device="cpu", dtype="float64"
        )
        energies.append(atoms.get_potential_energy())
    assert energies == pytest.approx([energies[0]] * len(energies), rel=1e-14)
    bj = ethanol.copy()
    bj.calc = NVAlchemiCalculator("d3-bj", device="cpu", dtype="float64")
    assert abs(bj.get_potential_energy() - energies[0]) > 1e-4


def test_d3_zero_passes_the_conformance_checks(pbe_d3_zero):
    from nvalchemi_ase import testing

    structures = _rattled()[2:5]  # slab, Si crystal, NaCl crystal
    report = testing.check_model(
        pbe_d3_zero, structures, dtype="float64", skip=("one_atom",)
    )
    for check in ("outputs", "forces", "stress", "batch", "translation"):
        assert report[check].startswith("passed"), report


@pytest.mark.slow
def test_d3_zero_nve_conserves_energy():
    from ase import units

    from nvalchemi_ase.md import VelocityVerlet

    model = load_model("d3-zero", cutoff=8.0)  # default taper, 0.2 of the cutoff
    images = [fcc111("Cu", (2, 2, 3), vacuum=6.0), molecule("C6H6")]
    for index, atoms in enumerate(images):
        rng = np.random.default_rng(index)
        scale = np.sqrt(atoms.get_masses()[:, None] * units.kB * 300)
        atoms.set_momenta(rng.normal(size=(len(atoms), 3)) * scale)
    dyn = VelocityVerlet(images, 1.0 * units.fs, model=model, dtype="float64")
    totals = []

    def sample():
        thermo = dyn.per_structure_thermo()
        totals.append(np.asarray(thermo["epot"]) + np.asarray(thermo["ekin"]))

    dyn.attach(sample, interval=2)
    dyn.run(40)
    spread = np.ptp(np.array(totals), axis=0)
    sizes = np.array([len(atoms) for atoms in images])
    assert (spread / sizes < ZERO_NVE_SPREAD_PER_ATOM).all(), spread


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


def test_kernel_tables_stay_float32_in_a_float64_model_with_the_same_numbers():
    """The [95, 95, 5, 5] tables are not converted at every call (#28 item 2).

    Reference: the same model with float64 tables (as before), which the
    kernel converts to float32 itself: results must be identical.
    """
    import torch

    model = load_model("d3", functional="pbe", cutoff=CUTOFF, smoothing_fraction=0)
    calc = NVAlchemiCalculator(model, device="cpu", dtype="float64")
    assert calc.model is model  # dtype check passed: the model is not copied
    assert calc.dtype == torch.float64  # the model's own dtype is still float64
    assert model.c6ab.dtype == model.cn_ref.dtype == torch.float32
    assert "c6ab" not in dict(model.named_buffers())
    moved = copy.deepcopy(model).to(dtype=torch.float32).to(dtype=torch.float64)
    assert moved.c6ab.dtype == torch.float32
    assert torch.equal(moved.c6ab, model.c6ab)
    structures = _structures()
    ours = calc.calculate_batch(structures, ["energy", "forces", "stress"])
    before = copy.deepcopy(model)
    for name in ("c6ab", "cn_ref"):  # the old layout: float64 tables
        setattr(before, name, getattr(before, name).to(torch.float64))
    old = NVAlchemiCalculator(before, device="cpu", dtype="float64")
    assert old.model.c6ab.dtype == torch.float64
    expected = old.calculate_batch(structures, ["energy", "forces", "stress"])
    for mine, ref in zip(ours, expected, strict=True):
        assert mine["energy"] == ref["energy"]
        np.testing.assert_array_equal(mine["forces"], ref["forces"])
        if "stress" in ref:
            np.testing.assert_array_equal(mine["stress"], ref["stress"])
