"""MACE through nvalchemi's ``MACEWrapper``, against mace-torch's ``MACECalculator``.

The model is a small random-weight ``ScaleShiftMACE`` built with mace-torch's
constructors (``tests/mace_models.py``) and saved whole, as MACE saves models.
The reference reads the same file with ``MACECalculator`` and evaluates each
structure alone (its own neighbour list, its own stress); ours evaluates the
whole mixed batch in one call. ``tests/data/mace_e3nn044.model`` was written by
mace-torch 0.3.15 on its pinned e3nn 0.4.4 (``tests/data/README.md``), like the
foundation checkpoints.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, fcc111, molecule

# found, not imported: the tests that use mace-torch import it (0.3 s of CPU
# beyond what collection imports anyway, on a worker that runs none of them)
if find_spec("mace") is None:
    pytest.skip("mace-torch not installed", allow_module_level=True)

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import StructureError
from nvalchemi_ase.md import VelocityVerlet
from nvalchemi_ase.models import load_model, model_native_dtype, supported_elements
from nvalchemi_ase.models import mace as mace_models
from nvalchemi_ase.models.weights import WEIGHTS_ENV, MissingWeightsError
from nvalchemi_ase.testing import check_model
from tests.mace_models import (
    LEGACY_FIXTURE_ARGS,
    TEST_CUTOFF,
    TEST_ELEMENTS,
    build_random_mace,
    save_random_mace,
)
from tests.structures import thermalize

# Same weights, same dtype, two codes: round-off of different summation orders
# (energy eV, forces eV/Å, stress eV/Å³).
TOLERANCES = {
    torch.float64: {"energy": 1e-9, "forces": 1e-10, "stress": 1e-12},
    torch.float32: {"energy": 2e-4, "forces": 2e-5, "stress": 2e-6},
}
LEGACY_FILE = Path(__file__).parent / "data" / "mace_e3nn044.model"
# NVE with the random-weight model, 8 and 4 atoms from 600 K: spread of the total
# energy over NVE_STEPS as a fraction of the kinetic energy's (measured 9.8e-5
# and 3.9e-5; excursions 0.055 and 0.011 eV).
NVE_STEPS = 60
NVE_TIMESTEP = 1.0 * units.fs
NVE_START_K = 600.0
NVE_DRIFT_FRACTION = 2e-3


def _rattled(atoms: Atoms, stdev: float, seed: int) -> Atoms:
    atoms.rattle(stdev, seed=seed)
    return atoms


def _ethanol_in_box() -> Atoms:
    atoms = molecule("CH3CH2OH")
    atoms.center(vacuum=4.0)
    return _rattled(atoms, 0.03, seed=1)


STRUCTURES = {
    "ethanol_in_box": _ethanol_in_box,  # molecule, cell but no pbc
    "water_no_cell": lambda: _rattled(molecule("H2O"), 0.03, seed=2),
    "Si_diamond_16": lambda: _rattled(
        bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 1, 1)), 0.05, seed=3
    ),
    "Cu111_slab": lambda: _rattled(fcc111("Cu", (2, 2, 3), vacuum=6.0), 0.04, 4),
    "AlN_primitive": lambda: _rattled(
        bulk("AlN", "wurtzite", a=3.11, c=4.98), 0.03, seed=5
    ),
    "Cu_one_atom": lambda: bulk("Cu", "fcc", a=3.61),  # sees its own images
}


def _periodic(atoms: Atoms) -> bool:
    # Stress is compared for periodic cells only: for a molecule in a box this
    # package reports the box's stress (as ASE's LJ), MACECalculator another.
    return bool(atoms.pbc.all())


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    """MACECalculator sets torch's global default dtype; later tests need theirs."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def test_loading_leaves_torchs_default_dtype_alone(model_file):
    before = torch.get_default_dtype()
    load_model("mace", path=model_file, dtype="float32")
    load_model("mace", path=LEGACY_FILE)
    assert torch.get_default_dtype() == before


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return save_random_mace(tmp_path_factory.mktemp("mace") / "random.model")


def _mace_calculator(dtype: str, **kwargs):
    from mace.calculators import MACECalculator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mace's torch.load and dtype notices
        return MACECalculator(device="cpu", default_dtype=dtype, **kwargs)


def _reference(calc, images: list[Atoms]) -> list[dict[str, np.ndarray]]:
    out = []
    for atoms in images:
        atoms = atoms.copy()
        atoms.calc = calc
        result = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        if _periodic(atoms):
            result["stress"] = atoms.get_stress()
        out.append(result)
    return out


def _assert_match(ours, reference, images, dtype) -> None:
    tol = TOLERANCES[dtype]
    for index, (mine, theirs, atoms) in enumerate(
        zip(ours, reference, images, strict=True)
    ):
        where = f"structure {index} ({atoms.get_chemical_formula()})"
        assert abs(mine["energy"] - theirs["energy"]) < tol["energy"], where
        np.testing.assert_allclose(
            mine["forces"], theirs["forces"], rtol=0, atol=tol["forces"], err_msg=where
        )
        if "stress" in theirs:
            np.testing.assert_allclose(
                mine["stress"], theirs["stress"], rtol=0, atol=tol["stress"]
            )
        elif atoms.cell.rank < 3:
            assert "stress" not in mine, where


@pytest.fixture(scope="module")
def images():
    return [build() for build in STRUCTURES.values()]


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)],
    ids=str,
)
def test_batch_matches_mace_calculator(model_file, images, dtype):
    name = str(dtype).removeprefix("torch.")
    model = load_model("mace", path=model_file, dtype=name)
    assert model_native_dtype(model) == dtype
    ours = NVAlchemiCalculator(model, device="cpu", dtype=dtype).calculate_batch(
        images, ["energy", "forces", "stress"]
    )
    reference = _reference(_mace_calculator(name, model_paths=str(model_file)), images)
    _assert_match(ours, reference, images, dtype)
    energies = [result["energy"] for result in reference]
    assert np.ptp(energies) > 1.0  # the structures are not alike (eV)


def test_elements_cutoff_and_dtype_come_from_the_file(model_file):
    model = load_model("mace", path=model_file)
    assert type(model).__name__ == "MACEWrapper"
    assert supported_elements(model) == frozenset(TEST_ELEMENTS)
    assert model.model_config.neighbor_config.cutoff == pytest.approx(TEST_CUTOFF)
    assert model_native_dtype(model) == torch.float64  # the file's own


def test_an_element_outside_the_z_table_is_refused_first(model_file, images):
    calc = NVAlchemiCalculator(load_model("mace", path=model_file), device="cpu")
    iron = bulk("Fe", "bcc", a=2.87)
    with pytest.raises(StructureError, match=r"images\[1\].*Fe"):
        calc.calculate_batch([images[2], iron])


@pytest.mark.slow
def test_a_file_written_under_e3nn_044_is_rebuilt_with_its_weights():
    model = load_model("mace", path=LEGACY_FILE)
    with mace_models._legacy_e3nn_codegen() as legacy:
        raw = torch.load(LEGACY_FILE, map_location="cpu", weights_only=False)
    assert legacy  # the fixture does have e3nn 0.4.4's layout
    raw_state, state = raw.state_dict(), model.model.state_dict()
    assert raw_state.keys() == state.keys()
    for key, value in raw_state.items():
        assert torch.equal(value, state[key]), key
    # reference: the same weights in a model built natively by the installed e3nn
    native = build_random_mace(**LEGACY_FIXTURE_ARGS)
    native.load_state_dict(raw_state)
    images = [STRUCTURES[name]() for name in ("ethanol_in_box", "Si_diamond_16")]
    ours = NVAlchemiCalculator(model, device="cpu").calculate_batch(
        images, ["energy", "forces", "stress"]
    )
    reference = _reference(_mace_calculator("float64", models=native), images)
    _assert_match(ours, reference, images, torch.float64)


def test_the_legacy_reader_leaves_e3nn_as_it_was():
    from e3nn.util.codegen._mixin import CodeGenMixin

    before = CodeGenMixin.__setstate__
    load_model("mace", path=LEGACY_FILE)
    assert CodeGenMixin.__setstate__ is before


def test_a_missing_foundation_file_names_file_address_and_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path))
    entry = mace_models.FOUNDATIONS["mace-mp-0-medium"]
    with pytest.raises(MissingWeightsError) as caught:
        load_model("mace-mp-0-medium")
    message = str(caught.value)
    assert entry.filename in message
    assert entry.url in message
    assert str(tmp_path / entry.filename) in message


@pytest.mark.parametrize(
    ("name", "default"),
    [("mace-mp-0-medium", torch.float32), ("mace-off23-small", torch.float64)],
)
def test_a_foundation_name_reads_its_file_from_the_weights_folder(
    model_file, tmp_path, monkeypatch, name, default
):
    entry = mace_models.FOUNDATIONS[name]
    shutil.copy(model_file, tmp_path / entry.filename)
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path))
    model = load_model(name)
    assert model_native_dtype(model) == default  # mace-torch's family default
    assert model_native_dtype(load_model(name, dtype="float64")) == torch.float64
    assert supported_elements(model) == frozenset(TEST_ELEMENTS)


def test_every_foundation_name_is_registered_with_its_facts():
    from nvalchemi_ase.models import registry

    for name, entry in mace_models.FOUNDATIONS.items():
        info = registry.lookup(name)
        assert info is not None, name
        assert info.extra == "mace"
        assert info.weights_file == entry.filename
        assert entry.url in info.weights
        assert entry.url.startswith("https://github.com/ACEsuit/")


def test_bad_files_and_arguments_fail_clearly(tmp_path, model_file):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.model"):
        load_model("mace", path=tmp_path / "nowhere.model")
    not_a_model = tmp_path / "dict.model"
    torch.save({"weights": torch.zeros(3)}, not_a_model)
    with pytest.raises(ValueError, match="not a MACE model"):
        load_model("mace", path=not_a_model)
    with pytest.raises(ValueError, match="dtype"):
        load_model("mace", path=model_file, dtype="float16")
    with pytest.raises(ValueError, match=r"no head 'pbe'.*\['Default'\]"):
        load_model("mace", path=model_file, head="pbe")
    with pytest.raises(TypeError, match="path"):
        load_model("mace", path=3)


def test_a_missing_mace_torch_names_the_install_commands(monkeypatch, model_file):
    monkeypatch.setitem(sys.modules, "mace.modules", None)
    with pytest.raises(ImportError, match=r"--no-deps mace-torch==0\.3\.15"):
        load_model("mace", path=model_file)


@pytest.mark.slow
def test_multi_head_models_evaluate_the_chosen_head(tmp_path):
    path = tmp_path / "two_heads.model"
    torch.save(build_random_mace(heads=["pbe", "default"], seed=3), path)
    images = [STRUCTURES[name]() for name in ("water_no_cell", "Si_diamond_16")]
    for head in ("pbe", "default"):
        model = load_model("mace", path=path, head=head)
        ours = NVAlchemiCalculator(model, device="cpu").calculate_batch(
            images, ["energy", "forces", "stress"]
        )
        calc = _mace_calculator("float64", model_paths=str(path), head=head)
        _assert_match(ours, _reference(calc, images), images, torch.float64)
    default = load_model("mace", path=path)  # like MACECalculator: 'default'
    assert default.head_index == 1


@pytest.mark.slow
def test_conformance_kit(model_file):
    report = check_model(
        load_model("mace", path=model_file),
        elements=("C", "O", "Si"),
        dtype="float64",
    )
    assert all(line.startswith(("passed", "skipped")) for line in report.values())


@pytest.mark.slow
def test_nve_conserves_energy(model_file):
    model = load_model("mace", path=model_file)
    images = [
        _rattled(bulk("Si", "diamond", a=5.43, cubic=True), 0.05, 8),
        _rattled(bulk("Cu", "fcc", a=3.61, cubic=True), 0.05, 9),
    ]
    for seed, atoms in enumerate(images):
        thermalize(atoms, NVE_START_K, seed)
    dyn = VelocityVerlet(images, NVE_TIMESTEP, model=model, dtype="float64")
    totals, kinetic = [], []

    def sample():
        totals.append([a.get_total_energy() for a in images])
        kinetic.append([a.get_kinetic_energy() for a in images])

    dyn.attach(sample, interval=5)
    dyn.run(NVE_STEPS)
    drift = np.ptp(np.array(totals), axis=0)
    excursion = np.ptp(np.array(kinetic), axis=0)
    assert (excursion > 0.01).all(), excursion  # kinetic <-> potential (eV)
    assert (drift < NVE_DRIFT_FRACTION * excursion).all(), (drift, excursion)


def test_a_mace_file_composes_with_d3_by_name_and_on_the_command_line(
    tmp_path, model_file
):
    """``my.model+d3``: the file's MACE plus D3, equal to the two evaluated apart."""
    pytest.importorskip("tad_dftd3")
    from ase.calculators.mixing import SumCalculator
    from ase.io import read, write

    from nvalchemi_ase.cli.main import main

    structures = [
        STRUCTURES[name]() for name in ("Si_diamond_16", "AlN_primitive", "Cu111_slab")
    ]
    for atoms in structures:
        atoms.info.pop("adsorbate_info", None)  # extxyz cannot write it
    parts = [
        NVAlchemiCalculator(
            load_model("mace", path=model_file), device="cpu", dtype="float64"
        ),
        NVAlchemiCalculator(load_model("d3(pbe)"), device="cpu", dtype="float64"),
    ]
    composed = NVAlchemiCalculator(
        load_model(f"{model_file}+d3(pbe)"), device="cpu", dtype="float64"
    )
    batched = composed.calculate_batch(structures, ["energy", "forces"])
    for atoms, result in zip(structures, batched, strict=True):
        reference = atoms.copy()
        reference.calc = SumCalculator(parts)
        assert result["energy"] == pytest.approx(
            reference.get_potential_energy(), abs=1e-8
        )
        np.testing.assert_allclose(
            result["forces"], reference.get_forces(), rtol=0, atol=1e-8
        )

    source = tmp_path / "in.extxyz"
    write(source, structures)
    out = tmp_path / "relaxed.extxyz"
    argv = ["relax", "--model", f"{model_file}+d3", "--dtype", "float64"]
    code = main([*argv, "--device", "cpu", str(source), "-o", str(out), "--quiet"])
    assert code in (0, None)
    frames = read(out, ":")
    assert len(frames) == len(structures)
    for frame in frames:
        energy = frame.get_potential_energy()
        frame.calc = SumCalculator(parts)
        assert energy == pytest.approx(frame.get_potential_energy(), abs=1e-8)


def test_a_missing_mace_file_in_a_composed_name_is_named_before_any_work(tmp_path):
    missing = tmp_path / "nowhere.model"
    with pytest.raises((FileNotFoundError, ValueError), match=r"nowhere\.model"):
        load_model(f"{missing}+d3")
