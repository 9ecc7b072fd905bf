"""Input validation: every bad input fails before any work, naming what to fix.

Each check raises before anything is built or computed, names the structure
(``images[i]``), the field and the fix, and leaves the user's ``Atoms``
untouched bit for bit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, molecule, niggli_reduce
from ase.constraints import FixAtoms
from ase.data import atomic_numbers
from ase.io.trajectory import Trajectory
from ase.neighborlist import primitive_neighbor_list

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.convert import (
    FROZEN_CATEGORY,
    MAX_PERIODIC_IMAGES,
    MIN_DISTANCE,
    StructureError,
    atoms_to_batch,
    check_images,
)
from nvalchemi_ase.devices import resolve_device
from nvalchemi_ase.models import load_model, supported_elements
from tests.structures import A_AR, cluster, rattled_bulk, slab

# -- helpers -------------------------------------------------------------------


def frozen_state(atoms: Atoms) -> dict:
    """Bytes of what a check could change: arrays, cell, pbc, info, constraints."""
    arrays = atoms.arrays.items()
    return {
        "arrays": {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays},
        "cell": atoms.cell.array.tobytes(),
        "pbc": atoms.pbc.tobytes(),
        "info": repr(atoms.info),
        "constraints": repr([c.todict() for c in atoms.constraints]),
    }


def raises_untouched(
    images: list[Atoms], call, index: int, field: str, error=StructureError
) -> str:
    """Run ``call()``, expect ``error`` naming ``images[index].field``; return it."""
    before = [frozen_state(atoms) for atoms in images]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    if error is StructureError:
        assert info.value.index == index
        assert info.value.field == field
        assert message.startswith(f"images[{index}].{field}:")
        assert ";" in message  # the fix follows the problem
    assert [frozen_state(atoms) for atoms in images] == before
    return message


def argon_pair(distance: float, cell: float | None = None) -> Atoms:
    """Two Ar atoms ``distance`` Å apart, in a periodic cube of ``cell`` Å if given."""
    atoms = Atoms("Ar2", positions=[[1.0, 1.0, 1.0], [1.0 + distance, 1.0, 1.0]])
    if cell is not None:
        atoms.set_cell(np.eye(3) * cell)
        atoms.pbc = True
    return atoms


def ase_frozen_mask(atoms: Atoms) -> np.ndarray:
    """Which atoms ASE's own constraint keeps in place when all are moved."""
    probe = atoms.copy()
    moved = probe.positions + 1.0
    probe.set_positions(moved)
    return np.all(probe.positions != moved, axis=1)


def skewed_cubic_argon() -> Atoms:
    """One Ar atom of a 5.26 Å simple cubic lattice, in a nearly degenerate basis.

    The unimodular matrix keeps the lattice (every distance is 5.26 Å or more)
    but its first two vectors are 1e-6 rad from parallel: the cell is 0.0037 Å
    high along them, and a neighbour search over this basis needs thousands of
    images per axis.
    """
    unimodular = np.array([[1000, 1001, 0], [999, 1000, 0], [0, 0, 1]])
    cell = unimodular @ (np.eye(3) * A_AR)
    return Atoms("Ar", positions=[[0.0, 0.0, 0.0]], cell=cell, pbc=True)


# -- 1. FixAtoms, per structure with ASE's rules --------------------------------


def test_negative_fixatoms_index_freezes_the_last_atom_of_its_own_structure():
    first = Atoms("Ar4", positions=np.arange(12.0).reshape(4, 3) * 2.0)
    second = first.copy()
    second.set_constraint(FixAtoms(indices=[-1]))
    batch = atoms_to_batch([first, second], device="cpu")
    frozen = (batch.atom_categories == FROZEN_CATEGORY).numpy()
    np.testing.assert_array_equal(
        frozen, np.concatenate([ase_frozen_mask(first), ase_frozen_mask(second)])
    )
    assert frozen.tolist() == [False] * 7 + [True]


def test_fixatoms_mask_freezes_what_ase_freezes():
    images = [rattled_bulk(repeat=2, seed=1), rattled_bulk(repeat=2, seed=2)]
    mask = images[1].positions[:, 0] < 3.0
    images[1].set_constraint(FixAtoms(mask=mask))
    np.testing.assert_array_equal(images[1].constraints[0].index, np.flatnonzero(mask))
    frozen = atoms_to_batch(images, device="cpu").atom_categories == FROZEN_CATEGORY
    expected = np.concatenate([ase_frozen_mask(a) for a in images])
    np.testing.assert_array_equal(frozen.numpy(), expected)


@pytest.mark.parametrize("index", [4, -5])
def test_fixatoms_index_outside_its_structure_is_a_structure_error(index):
    small = Atoms("Ar4", positions=np.arange(12.0).reshape(4, 3) * 2.0)
    small.set_constraint(FixAtoms(indices=[index]))
    with pytest.raises(IndexError):  # ASE refuses it too, when it applies it
        small.copy().set_positions(small.positions)
    images = [small, rattled_bulk(repeat=2)]
    message = raises_untouched(
        images, lambda: atoms_to_batch(images, device="cpu"), 0, "constraints"
    )
    assert f"FixAtoms index {index} is out of range" in message


# -- 2. atoms closer than MIN_DISTANCE, periodic images included -----------------


def test_coincident_atoms_are_refused_instead_of_giving_zero_energy(lj_calc64):
    dimer = argon_pair(0.0)
    dimer.calc = lj_calc64
    message = raises_untouched([dimer], dimer.get_potential_energy, 0, "positions[1]")
    assert "0 Å from atom 0" in message
    assert "duplicated site" in message


def test_pair_just_below_the_minimum_distance_is_refused_just_above_passes():
    check_images([argon_pair(MIN_DISTANCE * 1.01)])
    images = [cluster(), argon_pair(MIN_DISTANCE * 0.99)]
    message = raises_untouched(images, lambda: check_images(images), 1, "positions[1]")
    assert f"{MIN_DISTANCE * 0.99:.3g} Å" in message


def test_atom_on_a_periodic_image_of_another_is_refused():
    crystal = rattled_bulk(repeat=2)
    duplicate = crystal.positions[3] + crystal.cell[0] - [0.03, 0.0, 0.0]
    bad = crystal.copy()
    bad += Atoms("Ar", positions=[duplicate])
    images = [crystal, bad]
    message = raises_untouched(
        images, lambda: check_images(images), 1, f"positions[{len(crystal)}]"
    )
    assert "from atom 3 (a periodic image of it)" in message


def test_slab_atom_on_an_in_plane_image_of_another_is_refused():
    surface = slab()
    bad = surface.copy()
    bad += Atoms("Ar", positions=[surface.positions[0] + surface.cell[1]])
    images = [surface, bad]
    raises_untouched(
        images, lambda: check_images(images), 1, f"positions[{len(surface)}]"
    )


@pytest.mark.parametrize(
    "cell",
    [
        [0.05, 5.0, 5.0],  # a lattice vector shorter than the minimum
        [[A_AR, 0, 0], [A_AR, 1e-4, 0], [0, 0, A_AR]],  # 1e-4 Å from parallel
    ],
)
def test_atom_near_its_own_periodic_image_is_refused(cell):
    tiny = Atoms("Ar", positions=[[0.0, 0.0, 0.0]], cell=cell, pbc=True)
    images = [rattled_bulk(repeat=2), tiny]
    message = raises_untouched(images, lambda: check_images(images), 1, "cell")
    assert "from its own periodic image" in message


def test_distance_check_agrees_with_ases_neighbour_list():
    rng = np.random.default_rng(3)
    images, expected = [], []
    for _ in range(60):
        pbc = rng.random(3) < 0.6
        cell = np.diag(rng.uniform(1.0, 4.0, 3)) + rng.normal(0.0, 0.4, (3, 3))
        positions = rng.random((6, 3)) @ cell
        if rng.random() < 0.5:  # a partner near an atom or one of its images
            shift = rng.integers(-1, 2, 3) * pbc
            offset = rng.normal(size=3)
            offset *= rng.uniform(0.0, 2 * MIN_DISTANCE) / np.linalg.norm(offset)
            positions = np.vstack([positions, positions[0] + shift @ cell + offset])
        atoms = Atoms(f"Ar{len(positions)}", positions=positions, cell=cell, pbc=pbc)
        distances = primitive_neighbor_list(
            "d", pbc, cell, positions, MIN_DISTANCE, self_interaction=False
        )
        images.append(atoms)
        expected.append(len(distances) > 0)
    for atoms, close in zip(images, expected, strict=True):
        if close:
            with pytest.raises(StructureError):
                check_images(atoms)
        else:
            check_images(atoms)
    assert 5 < sum(expected) < 55  # both outcomes exercised
    first_bad = expected.index(True)
    with pytest.raises(StructureError) as info:
        check_images(images)  # all at once: the first bad structure is named
    assert info.value.index == first_bad


def test_skewed_basis_of_a_sane_lattice_passes_the_distance_check():
    skewed = skewed_cubic_argon()
    check_images(skewed)
    skewed += Atoms("Ar", positions=[[0.05, A_AR, 0.0]])  # near an image of atom 0
    message = raises_untouched(
        [skewed], lambda: check_images(skewed), 0, "positions[1]"
    )
    assert "0.05 Å from atom 0 (a periodic image of it)" in message


# -- 3. elements the model cannot evaluate --------------------------------------


def test_builtin_models_declare_their_elements():
    assert supported_elements(load_model("lj")) is None  # LJ ignores numbers
    # a composed model admits what all its parts admit (D3's tables here)
    assert supported_elements(load_model("lj+d3")) == supported_elements(
        load_model("d3")
    )
    demo = load_model("demo")
    embedding = demo.model.embedding.num_embeddings  # DemoModel(num_atom_types=100)
    assert supported_elements(demo) == frozenset(range(1, embedding))
    with pytest.raises(IndexError):  # the raw embedding refuses the next one
        demo.model.embedding(torch.tensor([embedding]))


def test_sevennet_elements_come_from_its_checkpoint():
    pytest.importorskip("sevenn")
    from nvalchemi_ase.models.sevennet import loading

    config = loading.check_checkpoint_is_data(loading.checkpoint_path())["config"]
    expected = frozenset(atomic_numbers[s] for s in config["chemical_species"])
    model = load_model("sevennet-0")
    assert len(expected) == 89
    assert supported_elements(model) == expected
    images = [bulk("Cu"), bulk("Po", "sc", a=3.35)]  # polonium is not in MPtrj
    message = raises_untouched(
        images, lambda: check_images(images, model=model), 1, "numbers[0]"
    )
    assert "Po" in message
    assert "89 elements" in message


def test_unsupported_element_fails_before_the_calculator_runs_the_model():
    calc = NVAlchemiCalculator("demo", device="cpu")
    einsteinium = Atoms("Es", positions=[[0.0, 0.0, 0.0]])  # Z = 99: supported
    einsteinium.calc = calc
    einsteinium.get_potential_energy()
    fermium = Atoms("ArFm", positions=[[0.0, 0.0, 0.0], [0.0, 0.0, 3.0]])  # Z = 100
    fermium.calc = calc
    message = raises_untouched([fermium], fermium.get_potential_energy, 0, "numbers[1]")
    assert "Fm" in message
    assert "H-Es" in message


def test_a_model_declares_its_elements_with_an_attribute():
    model = load_model("lj")
    model.supported_elements = frozenset({atomic_numbers["Ar"]})
    assert supported_elements(model) == {18}
    images = [rattled_bulk(repeat=2), molecule("H2O")]
    message = raises_untouched(
        images, lambda: check_images(images, model=model), 1, "numbers[0]"
    )
    assert "cannot evaluate H, O" in message


# -- 4. cells too thin for the model's cutoff ------------------------------------


def test_nearly_parallel_lattice_vectors_fail_fast_instead_of_hanging(lj_calc64):
    # This cell made LJ's neighbour search run for more than 15 minutes.
    atoms = Atoms(
        "Ar",
        positions=[[0.0, 0.0, 0.0]],
        cell=[[A_AR, 0, 0], [A_AR, 1e-4, 0], [0, 0, A_AR]],
        pbc=True,
    )
    atoms.calc = lj_calc64
    start = time.perf_counter()
    raises_untouched([atoms], atoms.get_potential_energy, 0, "cell")
    assert time.perf_counter() - start < 10.0


def test_skewed_cell_names_axis_height_and_cutoff_and_a_reduced_cell_passes():
    model = load_model("lj")
    skewed = skewed_cubic_argon()
    images = [rattled_bulk(repeat=2), skewed]
    start = time.perf_counter()
    message = raises_untouched(
        images, lambda: check_images(images, model=model, skin=1.0), 1, "cell"
    )
    assert time.perf_counter() - start < 10.0
    assert "periodic axis 0 is only 0.0037" in message
    assert "cutoff 8.5 Å + skin 1 Å" in message
    assert "niggli_reduce" in message
    niggli_reduce(skewed)
    check_images(images, model=model, skin=1.0)


def test_image_limit_counts_the_skin_and_the_suggested_supercell_fits():
    model = load_model("lj")  # cutoff 8.5 Å
    height = 8.5 / MAX_PERIODIC_IMAGES * 1.001  # just within the limit, no skin
    thin = Atoms("Ar", positions=[[0.0, 0.0, 0.0]], cell=[height, 6.0, 6.0], pbc=True)
    check_images(thin, model=model)
    message = raises_untouched(
        [thin], lambda: check_images(thin, model=model, skin=1.0), 0, "cell"
    )
    assert f"more than {MAX_PERIODIC_IMAGES}" in message
    assert "atoms * (2, 1, 1)" in message
    check_images(thin * (2, 1, 1), model=model, skin=1.0)


def test_dynamics_check_structures_before_building_anything(tmp_path):
    from nvalchemi_ase.md import VelocityVerlet

    kept = tmp_path / "md_0.traj"  # would be replaced by a run's first frame
    kept.write_bytes(b"not touched")
    images = [rattled_bulk(repeat=2), skewed_cubic_argon()]
    raises_untouched(
        images,
        lambda: VelocityVerlet(
            images,
            units.fs,
            model="lj",
            device="cpu",
            trajectory=str(tmp_path / "md_{i}.traj"),
        ),
        1,
        "cell",
    )
    assert kept.read_bytes() == b"not touched"  # nothing was set up


# -- 5. and 6. info numbers and per-atom arrays ----------------------------------


@pytest.mark.parametrize("key", ["charge", "spin"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), np.float64("-inf")])
def test_non_finite_charge_or_spin_is_refused(key, value):
    images = [rattled_bulk(repeat=2), cluster()]
    images[1].info[key] = value
    message = raises_untouched(
        images, lambda: atoms_to_batch(images, device="cpu"), 1, f'info["{key}"]'
    )
    assert "not finite" in message


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("tags", np.array([1, 2]), "has shape (2,)"),
        ("tags", np.linspace(0.0, 1.0, 32), "not integer"),
        ("masses", np.array(["heavy"] * 32), "not real numbers"),
        ("masses", np.ones(33), "has shape (33,)"),
        ("momenta", np.zeros((32, 2)), "has shape (32, 2)"),
        ("initial_charges", np.zeros(31), "has shape (31,)"),
        ("initial_charges", np.array([True] * 32), "not real numbers"),
    ],
)
def test_per_atom_array_of_wrong_length_or_dtype_is_a_structure_error(
    key, value, problem
):
    images = [cluster(), rattled_bulk(repeat=2)]
    images[1].arrays[key] = value  # ASE allows this; set_array would refuse
    message = raises_untouched(
        images, lambda: atoms_to_batch(images, device="cpu"), 1, key
    )
    assert problem in message


def test_non_finite_initial_charge_is_refused():
    images = [rattled_bulk(repeat=2)]
    charges = np.zeros(len(images[0]))
    charges[5] = np.nan
    images[0].set_initial_charges(charges)
    raises_untouched(
        images, lambda: atoms_to_batch(images, device="cpu"), 0, "initial_charges[5]"
    )


# -- 7. check_images' signature ----------------------------------------------------


def test_check_images_keeps_its_old_call_and_checks_skin():
    check_images(rattled_bulk(repeat=2))
    check_images([rattled_bulk(repeat=2), cluster(), slab()], model=load_model("lj"))
    with pytest.raises(TypeError, match="skin must be a number"):
        check_images(cluster(), skin="1")
    with pytest.raises(ValueError, match="skin must be finite and >= 0"):
        check_images(cluster(), skin=-1.0)


# -- 8. devices ------------------------------------------------------------------


@pytest.mark.parametrize("device", ["mps", "bogus", "xpu:0"])
def test_unknown_device_fails_at_construction_with_the_choices(device):
    with pytest.raises(ValueError, match="'cpu', 'cuda', 'cuda:N'"):
        NVAlchemiCalculator("lj", device=device)


def test_cuda_without_cuda_fails_at_construction():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
        return
    with pytest.raises(ValueError, match="CUDA is not available"):
        NVAlchemiCalculator("lj", device="cuda")


def test_device_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="device must be a str"):
        resolve_device(0)  # type: ignore[arg-type]


# -- 9. model parameters -------------------------------------------------------------


def test_model_parameter_of_wrong_type_names_parameter_and_type():
    from nvalchemi_ase.cli.common import parse_model_spec

    name, params = parse_model_spec("lj:epsilon=abc")
    with pytest.raises(TypeError, match=r"lj: epsilon must be a real number \(eV\)"):
        load_model(name, **params)
    with pytest.raises(TypeError, match=r"lj: cutoff must be a real number \(Å\)"):
        NVAlchemiCalculator("lj", cutoff="8.5")
    with pytest.raises(TypeError, match="demo: hidden_dim must be an integer"):
        load_model("demo", hidden_dim=64.0)
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['sigmaa'\]"):
        load_model("lj", sigmaa=3.4)


# -- 10. numeric arguments of the dynamics -------------------------------------------


@pytest.mark.parametrize(
    ("make", "argument", "unit"),
    [
        (lambda m, a: m.VelocityVerlet(a, "1", model="lj"), "timestep", "ASE time"),
        (lambda m, a: m.VelocityVerlet(a, True, model="lj"), "timestep", "ASE time"),
        (
            lambda m, a: m.Langevin(a, units.fs, "300", 0.01, model="lj"),
            "temperature_K",
            "K",
        ),
        (
            lambda m, a: m.Langevin(a, units.fs, 300, "0.01", model="lj"),
            "friction",
            "1/ASE time",
        ),
        (
            lambda m, a: m.Bussi(a, units.fs, [300, "400"], 100, model="lj"),
            "temperature_K",
            "K",
        ),
        (
            lambda m, a: m.NVTBerendsen(a, units.fs, 300, "100", model="lj"),
            "taut",
            "ASE time",
        ),
        (
            lambda m, a: m.NoseHooverChainNVT(a, units.fs, 300, 100, "3", model="lj"),
            "tchain",
            "thermostats",
        ),
        (
            lambda m, a: m.Andersen(a, units.fs, 300, "0.1", model="lj"),
            "andersen_prob",
            "probability",
        ),
    ],
)
def test_string_md_arguments_are_refused_naming_argument_and_unit(make, argument, unit):
    from nvalchemi_ase import md

    atoms = rattled_bulk(repeat=2)
    before = frozen_state(atoms)
    with pytest.raises(TypeError, match=f"{argument} must be") as info:
        make(md, atoms)
    assert unit in str(info.value)
    assert frozen_state(atoms) == before


@pytest.mark.parametrize(
    ("name", "kwargs", "argument", "unit"),
    [
        ("FIRE", {"dt": "0.1"}, "dt", "ASE time"),
        ("FIRE", {"Nmin": 5.0}, "Nmin", "steps"),
        ("FIRE2", {"maxstep": "0.2"}, "maxstep", "Å"),
        ("BFGS", {"alpha": "70"}, "alpha", "eV/Å²"),
        ("LBFGS", {"memory": "10"}, "memory", "stored steps"),
        ("MDMin", {"dt": "0.2"}, "dt", "ASE time"),
    ],
)
def test_string_optimizer_arguments_are_refused(name, kwargs, argument, unit):
    from nvalchemi_ase import optimize

    atoms = rattled_bulk(repeat=2)
    with pytest.raises(TypeError, match=f"{argument} must be") as info:
        getattr(optimize, name)(atoms, logfile=None, model="lj", **kwargs)
    assert unit in str(info.value)


# -- 11. trajectories and logs ---------------------------------------------------------


def test_two_structures_cannot_share_a_trajectory_file(tmp_path):
    from nvalchemi_ase.md import VelocityVerlet

    path = tmp_path / "shared.traj"
    path.write_bytes(b"old frames")
    images = [rattled_bulk(repeat=2, seed=1), rattled_bulk(repeat=2, seed=2)]
    for spec in ([path, path], [str(path), str(tmp_path / "." / "shared.traj")]):
        with pytest.raises(ValueError, match=r"images\[0\] and images\[1\] would both"):
            VelocityVerlet(images, units.fs, model="lj", device="cpu", trajectory=spec)
    assert path.read_bytes() == b"old frames"  # refused before deleting anything
    with (
        Trajectory(tmp_path / "open.traj", "w") as writer,
        pytest.raises(ValueError, match="same open Trajectory"),
    ):
        VelocityVerlet(
            images, units.fs, model="lj", device="cpu", trajectory=[writer, writer]
        )


@pytest.mark.parametrize(
    "template", ["md_{index}.traj", "md_{i}_{j}.traj", "md_{i:q}.traj"]
)
def test_trajectory_template_with_other_fields_is_refused(tmp_path, template):
    from nvalchemi_ase.md import VelocityVerlet

    images = [rattled_bulk(repeat=2, seed=1), rattled_bulk(repeat=2, seed=2)]
    with pytest.raises(ValueError, match=r"the only field is \{i\}"):
        VelocityVerlet(
            images,
            units.fs,
            model="lj",
            device="cpu",
            trajectory=str(tmp_path / template),
        )


def test_template_repeating_a_path_is_refused(tmp_path):
    from nvalchemi_ase.md import VelocityVerlet

    images = [rattled_bulk(repeat=2, seed=1), rattled_bulk(repeat=2, seed=2)]
    same = str(tmp_path / "md{i!s:.0}.traj")  # every index formats as ""
    with pytest.raises(ValueError, match="would both write"):
        VelocityVerlet(images, units.fs, model="lj", device="cpu", trajectory=same)


def test_trajectory_or_log_in_a_missing_directory_fails_at_construction(tmp_path):
    from nvalchemi_ase.md import VelocityVerlet

    missing = tmp_path / "no_such_dir"
    with pytest.raises(FileNotFoundError):  # what ASE's Trajectory raises
        Trajectory(missing / "x.traj", "w")
    images = [rattled_bulk(repeat=2, seed=1), rattled_bulk(repeat=2, seed=2)]
    with pytest.raises(FileNotFoundError, match=r"images\[0\]: directory"):
        VelocityVerlet(
            images,
            units.fs,
            model="lj",
            device="cpu",
            trajectory=str(missing / "md_{i}.traj"),
        )
    with pytest.raises(FileNotFoundError, match=r"logfile for images\[0\]"):
        VelocityVerlet(
            images,
            units.fs,
            model="lj",
            device="cpu",
            logfile=str(missing / "md_{i}.log"),
        )
    assert not missing.exists()
