"""The public conformance kit, ``nvalchemi_ase.testing``: passes and fails.

The project's models pass it (LJ in both precisions; the demo model on the
checks that apply to a point-cloud model; SevenNet-0 when ``sevenn`` is
installed), and deliberately broken LJ wrappers fail exactly the check that
covers their defect.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.calculators.calculator import all_changes

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.models import load_model
from nvalchemi_ase.models.builtin import ARGON
from nvalchemi_ase.testing import (
    CHECKS,
    TOLERANCES,
    check_batch_matches_single,
    check_forces_match_finite_differences,
    check_lattice_invariance,
    check_model,
    check_no_input_mutation,
    check_one_atom_cells,
    check_stress_matches_finite_differences,
    check_stress_only_for_full_cells,
    check_translation_invariance,
    default_structures,
    neighbour_distance,
    one_atom_structures,
)
from tests.structures import rattled_bulk

LJ = import_quietly("nvalchemi.models.lj").LennardJonesModelWrapper
ALL_PASSED = dict.fromkeys(CHECKS, "passed")
# Off the origin: the demo model's energy is singular at x = 0 (see below).
DEMO_OFFSET = np.array([1.1, 2.3, 3.7])  # Å


# -- deliberately broken models (each one defect) -------------------------------


class ScaledForcesLJ(LJ):
    """Forces 1 % too large: not the gradient of the energy."""

    def forward(self, data, **kwargs):
        outputs = super().forward(data, **kwargs)
        outputs["forces"] = outputs["forces"] * 1.01
        return outputs


class ScaledStressLJ(LJ):
    """Stress 1 % too large: not the strain derivative of the energy."""

    def forward(self, data, **kwargs):
        outputs = super().forward(data, **kwargs)
        if "stress" in outputs:
            outputs["stress"] = outputs["stress"] * 1.01
        return outputs


class MixedBatchLJ(LJ):
    """Each structure of a batch gets the previous structure's energy."""

    def forward(self, data, **kwargs):
        outputs = super().forward(data, **kwargs)
        outputs["energy"] = outputs["energy"].roll(1, dims=0)
        return outputs


class TetheredLJ(LJ):
    """LJ plus k·Σ|x|²: consistent forces and stress, not translation invariant."""

    K = 1e-3  # eV/Å²

    def forward(self, data, **kwargs):
        outputs = super().forward(data, **kwargs)
        x, graph = data.positions, data.batch_idx.long()
        energy = torch.zeros_like(outputs["energy"][:, 0])
        outputs["energy"] = outputs["energy"] + energy.index_add(
            0, graph, self.K * (x**2).sum(dim=1)
        ).unsqueeze(1)
        outputs["forces"] = outputs["forces"] - 2 * self.K * x
        if "stress" in outputs:  # (1/V) dE/dstrain = (2k/V) Σ x ⊗ x
            virial = torch.zeros_like(outputs["stress"]).index_add(
                0, graph, 2 * self.K * x[:, :, None] * x[:, None, :]
            )
            volume = torch.linalg.det(data.cell).abs()
            outputs["stress"] = outputs["stress"] + virial / volume[:, None, None]
        return outputs


class NoImagesLJ(LJ):
    """Drops the periodic shifts of the neighbour list (a classic PBC bug)."""

    def adapt_input(self, data, **kwargs):
        inputs = super().adapt_input(data, **kwargs)
        inputs["neighbor_matrix_shifts"] = None
        return inputs


class LoneAtomNaNLJ(LJ):
    """NaN energy for a structure of one atom."""

    def forward(self, data, **kwargs):
        outputs = super().forward(data, **kwargs)
        alone = (data.batch_ptr[1:] - data.batch_ptr[:-1]) == 1
        outputs["energy"] = torch.where(alone[:, None], torch.nan, outputs["energy"])
        return outputs


# -- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def lj_model(lj_calc64):
    return lj_calc64.model


@pytest.fixture(scope="module")
def demo_model():
    return load_model("demo")


@pytest.fixture(scope="module")
def argon():
    return default_structures()


@pytest.fixture(scope="module")
def demo_structures(argon):
    shifted = [atoms.copy() for atoms in argon]
    for atoms in shifted:
        atoms.positions += DEMO_OFFSET
    return shifted


def _passed(report):
    return {name: outcome.split(" ")[0] for name, outcome in report.items()}


# -- the project's models pass --------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lj_passes_every_check(dtype, lj_model):
    structures = default_structures()
    before = [atoms.copy() for atoms in structures]
    report = check_model(lj_model, structures, dtype=dtype)
    assert _passed(report) == ALL_PASSED
    assert structures == before  # the kit works on copies
    assert report["stress"] == "passed (4 structures)"  # the cluster has no cell
    assert report["lattice"] == "passed (4 structures)"  # ... and no pbc
    assert report["stress_rank"] == "passed (7 structures)"  # 5 + 2 cell variants


def test_a_model_name_is_accepted():
    report = check_model("lj", skip=sorted(set(CHECKS) - {"batch"}))
    assert report["batch"] == "passed (5 structures)"


def test_demo_model_passes_what_applies_to_a_point_cloud(demo_model, demo_structures):
    report = check_model(
        demo_model,
        demo_structures,
        periodic=False,
        translation_invariant=False,
        atoms_per_structure=2,
    )
    assert report == {
        "outputs": "passed (5 structures)",
        "forces": "passed (5 structures)",
        "stress": "skipped: the model has no stress output",
        "batch": "passed (5 structures)",
        "translation": "skipped: translation_invariant=False",
        "lattice": "skipped: periodic=False",
        "one_atom": "passed (4 structures)",
        "stress_rank": "passed (7 structures)",  # get_stress raises for all
        "mutation": "passed (10 structures)",
    }


def test_periodic_defaults_to_the_models_supports_pbc(demo_model, demo_structures):
    others = sorted(set(CHECKS) - {"lattice", "batch"})
    report = check_model(
        demo_model, demo_structures, translation_invariant=False, skip=others
    )
    assert report["lattice"] == "skipped: periodic=False"
    assert report["batch"] == "passed (5 structures)"
    assert report["mutation"] == "skipped: skip="


def test_demo_model_forces_are_singular_at_the_origin(demo_model, argon):
    """A property of nvalchemi's DemoModel, found by the kit (not a kit bug).

    Its coordinate embedding is ``LayerNorm(W x)`` with no bias: scale
    invariant in x, so the energy depends on the direction of each position
    vector and is singular at x = 0, where the 1-atom cell's atom sits
    (force -157 eV/Å); central differences there disagree.
    """
    one_atom_cell = argon[4]
    assert not one_atom_cell.positions.any()
    with pytest.raises(
        AssertionError,
        match=r"structures\[0\] \(Ar, 1 atoms.*forces vs finite differences",
    ):
        check_forces_match_finite_differences(demo_model, [one_atom_cell])


def test_the_demo_model_is_not_translation_invariant(demo_model, demo_structures):
    with pytest.raises(AssertionError, match=r"rigidly translated vs not: energy"):
        check_translation_invariance(demo_model, demo_structures)
    with pytest.raises(AssertionError, match=r"force on the only atom"):
        check_one_atom_cells(demo_model, demo_structures)


@pytest.fixture(scope="module")
def sevennet_model():
    pytest.importorskip("sevenn")
    return load_model("sevennet-0")  # float32, SevenNet's precision


@pytest.mark.slow
def test_sevennet_passes_every_check_but_one_atom(sevennet_model):
    """Two small Cu/Ni structures (SevenNet-0 costs ~0.1-1 s per call on a CPU)."""
    images = default_structures(("Cu", "Ni"))
    structures = [images[1], images[4]]  # triclinic 8 atoms, 1-atom cell
    report = check_model(sevennet_model, structures, atoms_per_structure=1)
    assert _passed(report) == ALL_PASSED


@pytest.mark.slow
def test_sevennet_an_isolated_atom(sevennet_model):
    # a batch without any edge: zero forces, not an autograd error
    assert check_one_atom_cells(sevennet_model, default_structures(("Cu",))[4:]) >= 1


# -- broken models fail the right check -----------------------------------------


def test_wrong_forces_fail_the_finite_difference_check(argon):
    model = ScaledForcesLJ(**ARGON)
    with pytest.raises(
        AssertionError,
        match=r"structures\[0\] \(Ar16.*forces vs finite differences \(step 1e-05 Å, "
        r"float64\): largest deviation .* eV/Å at atom \d+, component [xyz]",
    ):
        check_forces_match_finite_differences(model, argon, dtype="float64")
    assert check_batch_matches_single(model, argon, dtype="float64") == 5


def test_wrong_stress_fails_the_finite_difference_check(argon):
    model = ScaledStressLJ(**ARGON)
    with pytest.raises(
        AssertionError,
        match=r"structures\[0\].*stress vs finite differences.*component (xx|yy|zz)",
    ):
        check_stress_matches_finite_differences(model, argon, dtype="float64")
    assert check_forces_match_finite_differences(model, argon, dtype="float64") == 5


def test_a_batch_that_mixes_structures_fails_the_batch_check(argon):
    model = MixedBatchLJ(**ARGON)
    with pytest.raises(
        AssertionError, match=r"structures\[0\].*batched vs single: energy"
    ):
        check_batch_matches_single(model, argon, dtype="float64")
    # every other check evaluates one structure at a time: they cannot see it
    check_forces_match_finite_differences(model, argon, dtype="float64")
    check_translation_invariance(model, argon, dtype="float64")


def test_a_tethered_model_fails_translation_but_not_finite_differences(argon):
    model = TetheredLJ(**ARGON)
    check_forces_match_finite_differences(model, argon, dtype="float64")
    with pytest.raises(AssertionError, match=r"rigidly translated vs not: energy"):
        check_translation_invariance(model, argon, dtype="float64")
    with pytest.raises(AssertionError, match=r"lattice-translated vs original"):
        check_lattice_invariance(model, argon, dtype="float64")


def test_missing_periodic_images_fail_the_lattice_check():
    model = NoImagesLJ(**ARGON)
    crystal = [rattled_bulk(repeat=4)]  # 21 Å: no atom sees its own image
    check_translation_invariance(model, crystal, dtype="float64")
    with pytest.raises(
        AssertionError, match=r"structures\[0\].*lattice-translated vs original"
    ):
        check_lattice_invariance(model, crystal, dtype="float64")


def test_nan_for_one_atom_fails_the_one_atom_check():
    with pytest.raises(
        AssertionError, match=r"one-atom structures\[0\].*energy must be a finite"
    ):
        check_one_atom_cells(LoneAtomNaNLJ(**ARGON))


def test_a_calculator_that_wraps_the_users_atoms_fails_the_mutation_check(
    lj_model, argon, monkeypatch
):
    original = NVAlchemiCalculator.calculate

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        if atoms is not None:
            atoms.wrap()  # the bug: in place, on the user's Atoms
        original(self, atoms, properties, system_changes)

    structures = [atoms.copy() for atoms in argon]
    monkeypatch.setattr(NVAlchemiCalculator, "calculate", calculate)
    with pytest.raises(
        AssertionError,
        match=r"structures\[0\].*after calc\.get_\*\(atoms\): the user's Atoms "
        r"changed: arrays\['positions'\]",
    ):
        check_no_input_mutation(lj_model, structures)


def test_mutated_info_and_calc_results_are_named(lj_model, argon, monkeypatch):
    original = NVAlchemiCalculator.calculate_batch

    def calculate_batch(self, images, properties=("energy", "forces")):
        for atoms in images:
            atoms.info.pop("label", None)
            if atoms.calc is not None:
                atoms.calc.results["energy"] = 0.0
        return original(self, images, properties)

    monkeypatch.setattr(NVAlchemiCalculator, "calculate_batch", calculate_batch)
    with pytest.raises(
        AssertionError,
        match=r"structures\[0\].* with extras after calculate_batch: the user's "
        r"Atoms changed: info, calc_results",
    ):
        check_no_input_mutation(lj_model, argon[:1])


def test_check_model_names_every_failed_check(argon):
    with pytest.raises(AssertionError) as failure:
        check_model(TetheredLJ(**ARGON), argon, dtype="float64", skip=["mutation"])
    message = str(failure.value)
    assert message.startswith("2 of 8 checks failed for TetheredLJ:\n")
    assert "\n[translation] structures[0] (Ar16" in message
    assert "\n[lattice] structures[0] (Ar16" in message
    # forces and stress are the derivatives of its energy; its atoms at the
    # origin (1-atom structures) feel no tether
    assert message.count("\n[") == 2


# -- structures, tolerances and arguments -------------------------------------


def test_default_structures_cover_sizes_cells_and_periodicity():
    images = default_structures(("Cu", "Ni"))
    assert [len(a) for a in images] == [16, 8, 12, 13, 1]
    assert [a.cell.rank for a in images] == [3, 3, 3, 0, 3]
    assert ["".join("T" if p else "F" for p in a.pbc) for a in images] == [
        "TTT",
        "TTT",
        "TTF",
        "FFF",
        "TTT",
    ]
    assert {"Cu", "Ni"} <= set(images[0].get_chemical_symbols())
    angles = np.round(images[1].cell.cellpar()[3:], 1)  # triclinic: 57.2, 60.0, 57.7
    assert len(set(angles)) == 3
    assert not np.any(np.isclose(angles, 90))
    assert neighbour_distance(["Ar"]) == pytest.approx(5.26 / np.sqrt(2))
    assert default_structures() == default_structures()  # reproducible


def test_one_atom_structures():
    images = one_atom_structures(["Cu"])
    assert [a.cell.rank for a in images] == [3, 2, 0]
    assert [a.pbc.tolist() for a in images] == [
        [True] * 3,
        [True, True, False],
        [False] * 3,
    ]


def test_tolerances_are_named_per_dtype():
    tight, loose = TOLERANCES[torch.float64], TOLERANCES[torch.float32]
    assert tight.fd_force_atol < loose.fd_force_atol
    assert tight.fd_step < loose.fd_step


def test_bad_arguments_are_clear_errors(lj_model, demo_model, argon):
    with pytest.raises(ValueError, match=r"unknown checks \['forse'\]"):
        check_model(lj_model, skip=["forse"])
    with pytest.raises(ValueError, match="not both"):
        check_model(lj_model, argon, elements=("Ar",))
    with pytest.raises(ValueError, match="does not output stress"):
        check_stress_matches_finite_differences(demo_model, argon)
    with pytest.raises(ValueError, match="unknown chemical symbols"):
        default_structures(("Xx",))


def test_stress_rank_variants(lj_model, argon):
    assert check_stress_only_for_full_cells(lj_model, argon[2:4]) == 4
