"""The run object (``dynamics.run.BatchRun``): resized in place, captured as arrays.

References: each structure relaxed alone by the same optimizer class; a
structure that stays in a resized run, and one admitted into it, must follow
that path (float64, same engine: round-off only).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from nvalchemi_ase import optimize
from nvalchemi_ase.convert import atoms_to_batch
from tests._tolerances import EXACT
from tests.structures import cluster, rattled_bulk, small_cell_rattled, triclinic

# Same engine, same structure, same float64 model: round-off only.
PATH_ATOL = 1e-10
PACKAGE = Path(__file__).resolve().parents[1] / "nvalchemi_ase"


def _alone(atoms, calc, steps):
    copy = atoms.copy()
    copy.calc = calc
    optimize.FIRE(copy, logfile=None).run(fmax=1e-12, steps=steps)
    return copy.positions


def _stepped(run, model, count):
    """Prime the run, then ``count`` engine steps (hooks open as in a run)."""
    run.open_hooks()
    try:
        with model.narrowed_outputs({"energy", "forces"}):
            run.prime()
            for _ in range(count):
                run.step()
    finally:
        run.close_hooks()


def _positions(run, graph):
    batch = run.batch
    start, stop = batch.batch_ptr[graph : graph + 2].tolist()
    return batch.positions[start:stop].detach().cpu().numpy()


def _first_and_later() -> tuple[list, list]:
    """Three structures a run starts with, two admitted later (all sizes differ)."""
    return (
        [rattled_bulk(2, seed=1), triclinic(), small_cell_rattled()],
        [cluster(), rattled_bulk(2, seed=9)],
    )


def _relaxed_for(first: list, calc, steps: int) -> tuple[optimize.FIRE, list]:
    """FIRE on copies of ``first`` (``calc`` attached), run ``steps`` steps."""
    images = [atoms.copy() for atoms in first]
    for atoms in images:
        atoms.calc = calc
    opt = optimize.FIRE(images, logfile=None)
    opt.run(fmax=1e-12, steps=steps)
    return opt, images


def test_retire_and_admit_in_place_keep_every_path_as_alone(lj_calc64):
    first, later = _first_and_later()
    opt, _ = _relaxed_for(first, lj_calc64, steps=4)
    run = opt.batch_run
    engine = run.engine
    arrivals = atoms_to_batch(later, device="cpu", dtype=torch.float64)
    run.resize(np.array([2, 0]), arrivals)  # triclinic retired, order changed
    assert run.engine is engine  # no new engine: its state was resized
    assert run.size == 4
    assert run.guard.failed.shape == (4,)
    _stepped(run, opt.model, 6)
    for graph, (atoms, steps) in enumerate(
        [(first[2], 10), (first[0], 10), (later[0], 6), (later[1], 6)]
    ):
        np.testing.assert_allclose(
            _positions(run, graph),
            _alone(atoms, lj_calc64, steps),
            atol=PATH_ATOL,
            rtol=0,
        )


def test_capture_gives_plain_arrays_that_restore_bit_for_bit(lj_calc64, tmp_path):
    from nvalchemi_ase.dynamics.checkpoint import read_checkpoint

    def make(restart):
        images = [rattled_bulk(2, seed=3), small_cell_rattled()]
        for atoms in images:
            atoms.calc = lj_calc64
        return optimize.FIRE(images, logfile=None, restart=restart)

    path = tmp_path / "run.npz"
    opt = make(path)
    opt.run(fmax=1e-12, steps=3)
    counters, arrays = opt.batch_run.capture()
    assert set(counters) == {"engine_step_count", "random_seed", "stress_step"}
    assert all(isinstance(value, np.ndarray) for value in arrays.values())
    assert {"batch/positions", "failures/failed"} <= set(arrays)
    assert any(key.startswith("engine/") for key in arrays)
    assert any(key.startswith("neighbors/") for key in arrays)
    saved = read_checkpoint(path)
    for key, value in arrays.items():
        np.testing.assert_array_equal(saved.arrays[key], value)
    kept = tmp_path / "kept.npz"
    kept.write_bytes(path.read_bytes())
    uninterrupted = opt
    uninterrupted.run(fmax=1e-12, steps=6)
    continued = make(kept)
    continued.run(fmax=1e-12, steps=6)
    np.testing.assert_array_equal(
        continued.batch.positions.numpy(), uninterrupted.batch.positions.numpy()
    )


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize(
    ("module", "never"),
    [
        ("dynamics/checkpoint.py", {"base", "run"}),
        ("dynamics/run.py", {"base"}),
    ],
)
def test_checkpoint_and_run_never_import_the_ase_facing_base(module, never):
    imported = _imported_modules(PACKAGE / module)
    for name in never:
        assert f"nvalchemi_ase.dynamics.{name}" not in imported


def test_checkpoint_reads_no_private_member_of_the_dynamics_classes():
    tree = ast.parse((PACKAGE / "dynamics/checkpoint.py").read_text())
    private = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }
    assert not private


def test_resize_is_refused_where_per_structure_hooks_are_sized_once(lj_calc64):
    from ase.filters import FrechetCellFilter

    from nvalchemi_ase.md import Langevin, VelocityVerlet

    def fresh():
        atoms = rattled_bulk(2, seed=4)
        atoms.calc = lj_calc64
        return atoms

    filtered = optimize.FIRE(FrechetCellFilter(fresh()), logfile=None)
    # a schedule follows this object's step count, not an admitted structure's
    md = Langevin([fresh()], 1.0, temperature_K=[(0, 10.0), (10, 20.0)], friction=0.01)
    downhill = optimize.FIRE(fresh(), logfile=None, downhill_check=True)
    plain = optimize.FIRE(fresh(), logfile=None)
    assert plain.resizable()
    assert VelocityVerlet([fresh()], 1.0).resizable()  # NVE keeps no such state
    assert Langevin([fresh()], 1.0, temperature_K=10.0, friction=0.01).resizable()
    for dyn in (filtered, md, downhill):
        assert not dyn.resizable()
        with pytest.raises(ValueError, match="create a new object"):
            dyn.resize([0], [fresh()])


def _thermalized(calc, seed: int, repeat: int = 2):
    """A rattled argon cell at 30 K (``repeat`` per axis), evaluated by ``calc``."""
    from tests.structures import thermalize

    atoms = rattled_bulk(repeat, seed=seed)
    thermalize(atoms, 30.0, seed=seed)
    atoms.calc = calc
    return atoms


def test_velocity_verlet_resized_in_place_equals_each_structure_alone(lj_calc64):
    """Keep one structure mid-run and admit another: each goes on as alone."""
    from nvalchemi_ase.md import VelocityVerlet

    def fresh(seed, repeat=2):
        return _thermalized(lj_calc64, seed, repeat)

    first, kept, admitted = fresh(1), fresh(2), fresh(3)
    dyn = VelocityVerlet([first, kept], 2.0)
    dyn.run(5)
    dyn.resize([1], [admitted])
    dyn.run(5)
    alone_kept, alone_admitted = fresh(2), fresh(3)
    VelocityVerlet([alone_kept], 2.0).run(10)
    VelocityVerlet([alone_admitted], 2.0).run(5)
    for mine, alone in ((kept, alone_kept), (admitted, alone_admitted)):
        np.testing.assert_array_equal(mine.positions, alone.positions)
        np.testing.assert_array_equal(mine.get_momenta(), alone.get_momenta())


def _thermostats():
    """Each resizable NVT class, deterministic here, with per-structure arguments.

    Per class: constructor, its per-structure arguments for ``[first, kept]``
    and for the admitted structure, and fixed arguments. The stochastic ones
    run without noise (Langevin friction 0; Bussi and Andersen at 0 K, whose
    noise is then multiplied by zero), so their paths can be compared with
    each structure alone; their parameters still differ per structure.
    """
    from ase import units

    from nvalchemi_ase.md import (
        Andersen,
        Bussi,
        Langevin,
        NoseHooverChainNVT,
        NVTBerendsen,
    )

    fs = units.fs
    return {
        "NVTBerendsen": (
            NVTBerendsen,
            {"temperature_K": [100.0, 300.0], "taut": [50 * fs, 100 * fs]},
            {"temperature_K": 500.0, "taut": 80 * fs},
            {},
        ),
        "NoseHooverChainNVT": (
            NoseHooverChainNVT,
            {"temperature_K": [100.0, 300.0], "tdamp": [40 * fs, 90 * fs]},
            {"temperature_K": 200.0, "tdamp": 60 * fs},
            {},
        ),
        "Bussi": (
            Bussi,
            {"temperature_K": 0.0, "taut": [50 * fs, 100 * fs]},
            {"taut": 80 * fs},
            {"seed": 3},
        ),
        "Langevin": (
            Langevin,
            {"temperature_K": [100.0, 300.0], "friction": 0.0},
            {"temperature_K": 500.0},
            {"seed": 3},
        ),
        "Andersen": (
            Andersen,
            {"temperature_K": 0.0, "andersen_prob": [0.0, 0.0]},
            {"andersen_prob": 0.0},
            {"seed": 3},
        ),
    }


@pytest.mark.parametrize(
    "name", ["NVTBerendsen", "NoseHooverChainNVT", "Bussi", "Langevin", "Andersen"]
)
def test_thermostat_resized_in_place_equals_each_structure_alone(lj_calc64, name):
    """Keep one structure mid-run and admit another with its own parameters.

    Positions, momenta and every engine-state row (parameters, chain state,
    transferred energy) of each equal that structure's run alone.
    """
    from nvalchemi_ase._compat import engine_state
    from tests.structures import thermalize

    cls, given, admitted_given, fixed = _thermostats()[name]

    def fresh(seed, size=2):
        atoms = rattled_bulk(size, seed=seed)
        thermalize(atoms, 200.0, seed=seed)
        atoms.calc = lj_calc64
        return atoms

    def row(values, index):
        array = np.asarray(values, dtype=np.float64)
        return float(array) if array.ndim == 0 else float(array[index])

    first, kept, admitted = fresh(1), fresh(2), fresh(3, size=3)
    dyn = cls([first, kept], 2 * 0.5, **given, **fixed)
    dyn.run(5)
    dyn.resize([1], [admitted], parameters=admitted_given)
    dyn.run(5)
    alone_kept, alone_admitted = fresh(2), fresh(3, size=3)
    solo_kept = cls(
        [alone_kept], 1.0, **{k: row(v, 1) for k, v in given.items()}, **fixed
    )
    solo_kept.run(10)
    solo_admitted = cls(
        [alone_admitted],
        1.0,
        **({k: row(v, 0) for k, v in given.items()} | admitted_given),
        **fixed,
    )
    solo_admitted.run(5)
    for mine, alone in ((kept, alone_kept), (admitted, alone_admitted)):
        np.testing.assert_array_equal(mine.positions, alone.positions)
        np.testing.assert_array_equal(mine.get_momenta(), alone.get_momenta())
    state = engine_state(dyn.engine)
    for position, solo in enumerate((solo_kept, solo_admitted)):
        alone_state = engine_state(solo.engine)
        for key, value in alone_state:
            np.testing.assert_array_equal(
                getattr(state, key)[position].cpu().numpy(),
                value[0].cpu().numpy(),
                err_msg=f"engine state {key!r} of structure {position}",
            )
    for key in given:
        expected = [row(given[key], 1), row(admitted_given.get(key, given[key]), 0)]
        np.testing.assert_array_equal(dyn.parameter_table()[key], expected)


def test_thermostat_resize_refuses_missing_or_bad_parameters_and_changes_nothing(
    lj_calc64,
):
    from nvalchemi_ase.md import Langevin

    def fresh(seed):
        atoms = rattled_bulk(2, seed=seed)
        atoms.calc = lj_calc64
        return atoms

    dyn = Langevin([fresh(1), fresh(2)], 1.0, temperature_K=[10.0, 20.0], friction=0.01)
    dyn.run(2)
    with pytest.raises(ValueError, match="one value per structure: give parameters"):
        dyn.resize([1], [fresh(3)])
    with pytest.raises(ValueError, match=r"temperature_K for images\[1\] is -5.0"):
        dyn.resize([1], [fresh(3)], parameters={"temperature_K": -5.0})
    with pytest.raises(ValueError, match="not per-structure arguments"):
        dyn.resize([1], [fresh(3)], parameters={"temperature_K": 5.0, "taut": 1.0})
    assert len(dyn.images) == 2
    assert dyn.batch.num_graphs == 2
    np.testing.assert_array_equal(dyn.parameter_table()["temperature_K"], [10.0, 20.0])
    dyn.resize([1], [fresh(3)], parameters={"temperature_K": 30.0})
    np.testing.assert_array_equal(dyn.parameter_table()["temperature_K"], [20.0, 30.0])
    np.testing.assert_array_equal(dyn.parameter_table()["friction"], [0.01, 0.01])
    assert dyn.run(2)


def _counting_calls(model, monkeypatch) -> list[tuple[int, int]]:
    """(structures, atoms) of every model evaluation from now on."""
    calls: list[tuple[int, int]] = []
    forward = model.forward

    def counted(batch, *args, **kwargs):
        calls.append((int(batch.num_graphs), int(batch.num_nodes)))
        return forward(batch, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return calls


def _alone_results(atoms, calc):
    copy = atoms.copy()
    copy.calc = calc
    return copy.get_potential_energy(), copy.get_forces()


def test_a_refill_evaluates_the_admitted_structures_alone_as_they_are_alone(
    lj_calc64, monkeypatch
):
    first, later = _first_and_later()
    opt, images = _relaxed_for(first, lj_calc64, steps=3)
    survivors = [images[2].copy(), images[0].copy()]  # as they are now
    calls = _counting_calls(opt.model, monkeypatch)
    opt.resize([2, 0], [atoms.copy() for atoms in later])
    # one evaluation, of the admitted structures only: the survivors keep theirs
    assert calls == [(len(later), sum(len(atoms) for atoms in later))]
    batch = opt.batch
    tolerance = EXACT[torch.float64]
    for graph, atoms in enumerate([*survivors, *later]):
        energy, forces = _alone_results(atoms, lj_calc64)
        start, stop = batch.batch_ptr[graph : graph + 2].tolist()
        assert float(batch.energy[graph]) == pytest.approx(energy, abs=tolerance)
        np.testing.assert_allclose(
            batch.forces[start:stop].numpy(), forces, atol=tolerance, rtol=0
        )
    calls.clear()
    run = opt.batch_run
    run.open_hooks()
    try:
        with opt.model.narrowed_outputs({"energy", "forces"}):
            run.step()  # primed by the resize
    finally:
        run.close_hooks()
    assert calls == [(4, batch.num_nodes)]  # a step evaluates everyone
    for graph, (atoms, steps) in enumerate(
        [(first[2], 4), (first[0], 4), (later[0], 1), (later[1], 1)]
    ):
        np.testing.assert_allclose(
            _positions(opt.batch_run, graph),
            _alone(atoms, lj_calc64, steps),
            atol=PATH_ATOL,
            rtol=0,
        )


def test_retiring_without_admitting_evaluates_nothing(lj_calc64, monkeypatch):
    first, _ = _first_and_later()
    opt, _ = _relaxed_for(first, lj_calc64, steps=3)
    calls = _counting_calls(opt.model, monkeypatch)
    opt.resize([2, 0], [])
    assert calls == []  # the survivors keep their outputs and lists
    opt.run(fmax=1e-12, steps=2)
    survivors = (2, len(first[2]) + len(first[0]))
    assert calls == [survivors, survivors]  # two steps of the two survivors
    for graph, atoms in enumerate([first[2], first[0]]):
        np.testing.assert_allclose(
            _positions(opt.batch_run, graph),
            _alone(atoms, lj_calc64, 5),
            atol=PATH_ATOL,
            rtol=0,
        )


def test_admitted_structures_needing_more_neighbours_widen_the_list(
    lj_calc64, monkeypatch
):
    from ase import Atoms

    from nvalchemi_ase._compat import neighbor_hook_lists

    first = [  # few atoms, no periodic images: a list 16 wide
        Atoms("Ar3", positions=[[0, 0, 0], [3.9, 0, 0], [0.2, 3.7, 0.1]]),
        Atoms("Ar3", positions=[[0, 0, 0], [3.6, 0.3, 0], [0, 0.1, 4.0]]),
    ]
    later = [rattled_bulk(2, seed=9)]  # about a hundred neighbours an atom
    images = [atoms.copy() for atoms in first]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = optimize.FIRE(images, logfile=None)
    opt.run(fmax=1e-12, steps=2)
    (hook,) = opt.batch_run.neighbor_hooks()
    narrow = int(neighbor_hook_lists(hook)["matrix"].shape[1])
    survivor = images[1].copy()
    calls = _counting_calls(opt.model, monkeypatch)
    opt.resize([1], [atoms.copy() for atoms in later])
    assert calls == [(1, len(later[0]))]
    (hook,) = opt.batch_run.neighbor_hooks()
    assert int(neighbor_hook_lists(hook)["matrix"].shape[1]) > narrow
    batch = opt.batch
    for graph, atoms in enumerate([survivor, later[0]]):
        energy, forces = _alone_results(atoms, lj_calc64)
        start, stop = batch.batch_ptr[graph : graph + 2].tolist()
        assert float(batch.energy[graph]) == pytest.approx(
            energy, abs=EXACT[torch.float64]
        )
        np.testing.assert_allclose(
            batch.forces[start:stop].numpy(), forces, atol=EXACT[torch.float64], rtol=0
        )
    opt.run(fmax=1e-12, steps=3)
    for graph, (atoms, steps) in enumerate([(first[1], 5), (later[0], 3)]):
        np.testing.assert_allclose(
            _positions(opt.batch_run, graph),
            _alone(atoms, lj_calc64, steps),
            atol=PATH_ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("before_first_run", [True, False])
def test_resized_trajectories_hold_each_step_once_as_alone(
    lj_calc64, tmp_path, before_first_run
):
    """An admitted structure's file: its step 0, then one frame per step, as alone.

    Admitted before the first run, its step 0 was written at the resize and
    must not be written again when the run starts (ASE writes the initial
    frame once).
    """
    from ase.io import read

    from nvalchemi_ase.md import VelocityVerlet

    def fresh(seed, repeat=2):
        return _thermalized(lj_calc64, seed, repeat)

    # the admitted structure is smaller than the two it joins
    first, kept, admitted = fresh(1), fresh(2), fresh(3, repeat=1)
    dyn = VelocityVerlet([first, kept], 2.0, trajectory=str(tmp_path / "md_{i}.traj"))
    if not before_first_run:
        dyn.run(2)
    dyn.resize([1], [admitted], trajectories=[str(tmp_path / "admitted.traj")])
    dyn.run(3)
    dyn.close()
    alone = fresh(3, repeat=1)
    reference = VelocityVerlet([alone], 2.0, trajectory=str(tmp_path / "alone.traj"))
    reference.run(3)
    reference.close()

    frames = read(tmp_path / "admitted.traj", ":")
    expected = read(tmp_path / "alone.traj", ":")
    assert len(frames) == len(expected) == 4
    for mine, theirs in zip(frames, expected, strict=True):
        np.testing.assert_array_equal(mine.positions, theirs.positions)
        np.testing.assert_array_equal(mine.get_momenta(), theirs.get_momenta())
    kept_frames = read(tmp_path / "md_1.traj", ":")
    assert len(kept_frames) == (6 if not before_first_run else 4)
    for earlier, later in itertools.pairwise(kept_frames):  # no frame repeated
        assert not np.array_equal(earlier.positions, later.positions)
