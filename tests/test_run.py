"""The run object (``dynamics.run.BatchRun``): resized in place, captured as arrays.

References: each structure relaxed alone by the same optimizer class; a
structure that stays in a resized run, and one admitted into it, must follow
that path (float64, same engine: round-off only).
"""

from __future__ import annotations

import ast
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


def test_retire_and_admit_in_place_keep_every_path_as_alone(lj_calc64):
    first = [rattled_bulk(2, seed=1), triclinic(), small_cell_rattled()]
    later = [cluster(), rattled_bulk(2, seed=9)]
    images = [atoms.copy() for atoms in first]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = optimize.FIRE(images, logfile=None)
    opt.run(fmax=1e-12, steps=4)
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

    from nvalchemi_ase.md import VelocityVerlet

    def fresh():
        atoms = rattled_bulk(2, seed=4)
        atoms.calc = lj_calc64
        return atoms

    filtered = optimize.FIRE(FrechetCellFilter(fresh()), logfile=None)
    md = VelocityVerlet([fresh()], 1.0)
    downhill = optimize.FIRE(fresh(), logfile=None, downhill_check=True)
    plain = optimize.FIRE(fresh(), logfile=None)
    assert plain.resizable()
    for dyn in (filtered, md, downhill):
        assert not dyn.resizable()
        with pytest.raises(ValueError, match="create a new object"):
            dyn.resize([0], [fresh()])


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
    first = [rattled_bulk(2, seed=1), triclinic(), small_cell_rattled()]
    later = [cluster(), rattled_bulk(2, seed=9)]
    images = [atoms.copy() for atoms in first]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = optimize.FIRE(images, logfile=None)
    opt.run(fmax=1e-12, steps=3)
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
    first = [rattled_bulk(2, seed=1), triclinic(), small_cell_rattled()]
    images = [atoms.copy() for atoms in first]
    for atoms in images:
        atoms.calc = lj_calc64
    opt = optimize.FIRE(images, logfile=None)
    opt.run(fmax=1e-12, steps=3)
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
