"""High-throughput runners: bounded working batch, refills, streaming, resume.

References are independent runs of the same optimizer class on each structure
alone; in float64 the in-flight path must end where that run ends.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.constraints import Hookean
from ase.io import iread, read, write

from nvalchemi_ase import NVAlchemiCalculator, optimize
from nvalchemi_ase.runners import (
    Budget,
    RunStopped,
    failed_path,
    finished_indices,
    imd,
    irelax,
    isingle_points,
    md,
    read_results,
    relax,
    single_points,
    sort_output,
)
from tests.helpers import frames_by_index
from tests.structures import A_AR, mixed

# Same engine, same structure, same float64 model: round-off only.
PATH_ATOL = 1e-8
FMAX = 0.02


@pytest.fixture(scope="module")
def calc():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


@pytest.fixture
def eager_refills(monkeypatch):
    """Refill as soon as a structure finished and the next fits.

    The default schedule waits until the frozen structures have cost about
    a refill; on these small sets that is often the batch's end, so the
    survivors' carried state would go untested.
    """
    from nvalchemi_ase.runners import relaxation

    monkeypatch.setattr(relaxation, "_REFILL_STEPS", 0.0)


def _counting_rebuilds(monkeypatch) -> list[tuple[int, int]]:
    """(survivors, admitted) of every rebuild of the working batch, as it happens."""
    from nvalchemi_ase.runners import relaxation

    rebuilds: list[tuple[int, int]] = []
    rebuild = relaxation._Runner._rebuild

    def counted(self, survivors, admitted):
        rebuilds.append((len(survivors), len(admitted)))
        return rebuild(self, survivors, admitted)

    monkeypatch.setattr(relaxation._Runner, "_rebuild", counted)
    return rebuilds


def _alone(
    atoms: Atoms, calc, optimizer: str, steps: int = 1000, fmax: float = FMAX
) -> tuple:
    copy = atoms.copy()
    copy.calc = calc
    opt = getattr(optimize, optimizer)(copy, logfile=None)
    opt.run(fmax=fmax, steps=steps)
    return copy, int(opt.converged_at_step[0])


def _snapshot(images: list[Atoms]) -> list[tuple]:
    return [(a.positions.copy(), a.cell.array.copy(), a.calc) for a in images]


class Counting:
    """Wraps an iterable; counts how many items were pulled."""

    def __init__(self, items):
        self._items = iter(items)
        self.pulled = 0

    def __iter__(self):
        for item in self._items:
            self.pulled += 1
            yield item


@pytest.mark.parametrize(
    ("count", "largest"),
    [(64, 30), pytest.param(300, 200, marks=pytest.mark.slow)],
    ids=["64-up-to-30-atoms", "300-up-to-200-atoms"],
)
@pytest.mark.usefixtures("eager_refills")
def test_many_mixed_structures_refilled_each_end_as_alone(calc, count, largest):
    images = mixed(count, largest=largest)
    before = _snapshot(images)
    stream = Counting(images)
    in_flight = []
    by_index = {}
    for index, atoms in irelax(
        stream, calc, optimizer="MDMin", fmax=FMAX, max_atoms=largest + 60
    ):
        by_index[index] = atoms
        in_flight.append(stream.pulled - len(by_index))
        assert atoms.info["failure"] is None
        assert atoms.info["converged"] is True
    assert sorted(by_index) == list(range(count))
    assert list(by_index) != sorted(by_index)  # finish order, not input order
    assert max(in_flight) < 40  # bounded working batch (one read ahead)
    worst = 0.0
    for index, atoms in enumerate(images):
        result = by_index[index]
        expected, steps = _alone(atoms, calc, "MDMin")
        assert result.info["steps"] == steps
        worst = max(worst, float(np.abs(result.positions - expected.positions).max()))
        assert result.get_potential_energy() == pytest.approx(
            expected.get_potential_energy(), abs=1e-10
        )
        assert np.linalg.norm(result.get_forces(), axis=1).max() < FMAX
    assert worst < PATH_ATOL
    for atoms, (positions, cell, old_calc) in zip(images, before, strict=True):
        assert np.array_equal(atoms.positions, positions)
        assert np.array_equal(atoms.cell.array, cell)
        assert atoms.calc is old_calc
    assert len({r.info["steps"] for r in by_index.values()}) > 5  # steps vary


@pytest.mark.parametrize("optimizer", ["BFGS", "MDMin", "FIRE"])
def test_exact_optimizers_follow_their_alone_path_in_flight(
    calc, optimizer, eager_refills, monkeypatch
):
    rebuilds = _counting_rebuilds(monkeypatch)
    images = mixed(10, seed=1, largest=30)
    results = relax(images, calc, optimizer=optimizer, fmax=FMAX, max_atoms=50)
    assert any(survivors and admitted for survivors, admitted in rebuilds)
    for atoms, result in zip(images, results, strict=True):
        expected, steps = _alone(atoms, calc, optimizer)
        np.testing.assert_allclose(
            result.positions, expected.positions, atol=PATH_ATOL, rtol=0
        )
        assert result.info["steps"] == steps


@pytest.mark.parametrize("optimizer", ["FIRE", "FIRE2", "LBFGS"])
@pytest.mark.usefixtures("eager_refills")
def test_nvalchemi_optimizers_reach_their_alone_minimum_in_flight(calc, optimizer):
    # nvalchemi's kernels reduce per structure with atomics, so a batched path
    # can differ from the lone one by round-off amplified at FIRE's resets
    # (FIRE2: ~1e-5 Å for one structure of a plain 5-structure batch, without
    # any refill); minima agree.
    images = mixed(10, seed=1, largest=30)
    results = relax(images, calc, optimizer=optimizer, fmax=FMAX, max_atoms=50)
    for atoms, result in zip(images, results, strict=True):
        expected, _ = _alone(atoms, calc, optimizer)
        assert result.info["converged"] is True
        assert result.get_potential_energy() == pytest.approx(
            expected.get_potential_energy(), abs=1e-6
        )


def test_default_schedule_batches_refills_and_changes_no_path(calc, monkeypatch):
    from nvalchemi_ase.runners import relaxation

    images = mixed(24, seed=6, largest=30)
    rebuilds = _counting_rebuilds(monkeypatch)
    batched = relax(images, calc, optimizer="FIRE", fmax=FMAX, max_atoms=90)
    default = len(rebuilds)
    rebuilds.clear()
    monkeypatch.setattr(relaxation, "_REFILL_STEPS", 0.0)
    eager = relax(images, calc, optimizer="FIRE", fmax=FMAX, max_atoms=90)
    assert default < len(rebuilds)
    for mine, reference in zip(batched, eager, strict=True):
        assert mine.info["steps"] == reference.info["steps"]
        np.testing.assert_allclose(
            mine.positions, reference.positions, atol=PATH_ATOL, rtol=0
        )


@pytest.mark.usefixtures("eager_refills")
def test_a_refill_evaluates_the_admitted_structures_only(calc, monkeypatch):
    from nvalchemi_ase.runners import relaxation

    images = mixed(24, seed=6, largest=30)
    events: list[tuple] = []
    forward = calc.model.forward
    rebuild = relaxation._Runner._rebuild

    def counted(batch, *args, **kwargs):
        events.append(("call", int(batch.num_graphs), int(batch.num_nodes)))
        return forward(batch, *args, **kwargs)

    def refill(self, survivors, admitted):
        events.append(("refill", len(survivors), len(admitted)))
        rebuild(self, survivors, admitted)
        events.append(("end", len(survivors), sum(len(s.atoms) for s in admitted)))

    monkeypatch.setattr(calc.model, "forward", counted)
    monkeypatch.setattr(relaxation._Runner, "_rebuild", refill)
    results = relax(images, calc, optimizer="FIRE", fmax=FMAX, max_atoms=90)
    assert all(atoms.info["converged"] for atoms in results)
    starts = [i for i, event in enumerate(events) if event[0] == "refill"]
    with_survivors = 0
    for start in starts:
        _, survivors, admitted = events[start]
        end = next(i for i in range(start, len(events)) if events[i][0] == "end")
        atoms = events[end][2]
        calls = [event[1:] for event in events[start:] if event[0] == "call"]
        if admitted:  # the next evaluation is the admitted structures' alone
            assert calls[0] == (admitted, atoms)
        if survivors:  # in place: evaluated inside the refill, or nothing
            inside = [event[1:] for event in events[start + 1 : end]]
            assert inside == ([(admitted, atoms)] if admitted else [])
            with_survivors += bool(admitted)
    assert with_survivors >= 3


def test_optimizer_class_and_its_arguments_are_accepted(calc):
    images = mixed(4, seed=2, largest=30)
    results = relax(images, calc, optimizer=optimize.MDMin, dt=0.1, fmax=FMAX)
    for atoms, result in zip(images, results, strict=True):
        copy = atoms.copy()
        copy.calc = calc
        optimize.MDMin(copy, logfile=None, dt=0.1).run(fmax=FMAX)
        np.testing.assert_allclose(result.positions, copy.positions, atol=PATH_ATOL)


def test_step_limit_is_per_structure_and_reported(calc):
    images = mixed(8, seed=3, largest=30)
    results = relax(images, calc, optimizer="BFGS", fmax=1e-4, steps=7, max_atoms=50)
    for atoms, result in zip(images, results, strict=True):
        expected, steps = _alone(atoms, calc, "BFGS", steps=7, fmax=1e-4)
        np.testing.assert_allclose(
            result.positions, expected.positions, atol=PATH_ATOL, rtol=0
        )
        assert result.info["converged"] is (steps >= 0)
        assert result.info["steps"] == (steps if steps >= 0 else 7)


def _poison_size(model, natoms: int, after: int):
    """NaN forces for every graph of ``natoms`` atoms from its ``after``-th call on."""
    original = model.forward
    seen = {"n": 0}

    def forward(batch, *args, **kwargs):
        outputs = original(batch, *args, **kwargs)
        counts = batch.num_nodes_per_graph
        if bool((counts == natoms).any()):
            seen["n"] += 1
            if seen["n"] >= after:
                rows = counts[batch.batch_idx.long()] == natoms
                forces = outputs["forces"].clone()
                forces[rows] = float("nan")
                outputs["forces"] = forces
        return outputs

    model.forward = forward
    return lambda: model.__dict__.pop("forward", None)


def test_structure_exploding_mid_run_fails_alone_and_its_slot_is_refilled():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = [a for a in mixed(24, seed=4, largest=40) if len(a) != 7]
    bad = bulk("Ar", "fcc", a=A_AR) * (7, 1, 1)
    bad.rattle(0.1, seed=9)
    images.insert(3, bad)
    stream = Counting(images)
    undo = _poison_size(calc.model, 7, after=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # failures are results, not warnings
            outcome = []
            for index, atoms in irelax(
                stream, calc, optimizer="MDMin", fmax=FMAX, max_atoms=60
            ):
                outcome.append((index, atoms, stream.pulled))
    finally:
        undo()
    by_index = {index: atoms for index, atoms, _ in outcome}
    assert sorted(by_index) == list(range(len(images)))
    failed = by_index[3]
    assert "non-finite" in failed.info["failure"]
    assert failed.info["converged"] is False
    assert failed.info["steps"] >= 2
    assert np.isfinite(failed.positions).all()
    pulled_at_failure = next(p for i, _, p in outcome if i == 3)
    assert pulled_at_failure < len(images)  # others were admitted after it
    others = [i for i in by_index if i != 3]
    assert all(by_index[i].info["converged"] for i in others)
    clean = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for index in others[:6]:
        expected, _ = _alone(images[index], clean, "MDMin")
        np.testing.assert_allclose(
            by_index[index].positions, expected.positions, atol=PATH_ATOL, rtol=0
        )


def test_too_large_or_unsupported_structures_fail_with_a_reason(calc):
    images = mixed(5, seed=5, largest=40)
    images.insert(1, bulk("Ar", "fcc", a=A_AR) * (5, 5, 4))  # 100 atoms
    dimer = Atoms("Ar2", positions=[[0, 0, 0], [3.9, 0, 0]])
    dimer.set_constraint(Hookean(0, 1, k=1.0, rt=4.0))
    images.insert(4, dimer)
    results = relax(images, calc, optimizer="FIRE2", fmax=FMAX, max_atoms=60)
    assert "max_atoms=60" in results[1].info["failure"]
    assert "Hookean" in results[4].info["failure"]
    assert all(
        r.info["failure"] is None for i, r in enumerate(results) if i not in (1, 4)
    )


def test_memory_budget_is_the_default_and_refuses_what_does_not_fit(calc):
    budget = Budget.for_calculator(calc, None, None)
    assert budget.max_bytes is not None
    assert budget.max_atoms is None
    tiny = Budget(max_bytes=1e6, estimate=budget.estimate, cutoff=budget.cutoff)
    assert tiny.refusal(tiny.cost(bulk("Ar", "fcc", a=A_AR) * (5, 5, 4)))
    assert tiny.refusal(tiny.cost(bulk("Ar", "fcc", a=A_AR))) is None


def test_generator_over_an_extxyz_runs_with_a_bounded_batch(calc, tmp_path):
    path = tmp_path / "many.extxyz"
    frames = []
    for seed in range(40):
        atoms = bulk("Ar", "fcc", a=A_AR) * (2, 2, 1)
        atoms.rattle(0.03 + 0.003 * seed, seed=seed)
        frames.append(atoms)
    write(path, frames, format="extxyz")
    stream = Counting(iread(path, index=":"))
    largest = 0
    count = 0
    for count, (_, atoms) in enumerate(
        irelax(stream, calc, optimizer="MDMin", fmax=FMAX, max_atoms=24), start=1
    ):
        largest = max(largest, stream.pulled - count)
        assert atoms.info["converged"]
    assert count == 40
    assert largest <= 24 // 4 + 1  # six 4-atom structures in flight, one read ahead


def test_streamed_output_resumes_to_the_uninterrupted_content(calc, tmp_path):
    images = mixed(16, seed=6, largest=40)
    images.insert(5, bulk("Ar", "fcc", a=A_AR) * (5, 5, 4))  # refused: too large
    full = tmp_path / "full.extxyz"
    relax(images, calc, optimizer="MDMin", fmax=FMAX, max_atoms=80, output=full)
    part = tmp_path / "part.extxyz"
    run = irelax(images, calc, optimizer="MDMin", fmax=FMAX, max_atoms=80, output=part)
    first = list(itertools.islice(run, 7))
    run.close()
    assert len(read_results(part)) == 7
    assert {i for i, _ in first} == {int(a.info["index"]) for a in read_results(part)}
    resumed = relax(
        images,
        calc,
        optimizer="MDMin",
        fmax=FMAX,
        max_atoms=80,
        output=part,
        resume=True,
    )
    assert [int(a.info["index"]) for a in resumed] == list(range(len(images)))
    expected, got = read_results(full), read_results(part)
    assert [int(a.info["index"]) for a in got] == list(range(len(images)))
    assert failed_path(part).exists()
    for want, have in zip(expected, got, strict=True):
        assert have.info["failure"] == want.info["failure"]
        assert have.info["steps"] == want.info["steps"]
        np.testing.assert_allclose(have.positions, want.positions, atol=1e-8)
        if want.info["failure"] is None:
            assert have.get_potential_energy() == pytest.approx(
                want.get_potential_energy(), abs=1e-10
            )
    assert "max_atoms" in got[5].info["failure"]


def test_single_points_in_chunks_equal_one_batched_call(calc, tmp_path):
    images = mixed(12, seed=7, largest=40)
    images.append(bulk("Ar", "fcc", a=A_AR) * (5, 5, 4))
    output = tmp_path / "sp.extxyz"
    results = single_points(images, calc, max_atoms=60, output=output)
    reference = calc.calculate_batch(images[:-1], ["energy", "forces"])
    for result, want in zip(results[:-1], reference, strict=True):
        assert result.get_potential_energy() == pytest.approx(want["energy"], abs=1e-10)
        np.testing.assert_allclose(result.get_forces(), want["forces"], atol=1e-10)
    assert "max_atoms=60" in results[-1].info["failure"]
    assert [int(a.info["index"]) for a in read_results(output)] == list(range(13))


def test_bad_arguments_are_refused(calc):
    with pytest.raises(ValueError, match="optimizer"):
        relax(mixed(1), calc, optimizer="GPMin")
    with pytest.raises(TypeError, match="optimizer"):
        relax(mixed(1), calc, optimizer=dict)
    with pytest.raises(ValueError, match="max_atoms"):
        relax(mixed(1), calc, max_atoms=0)
    with pytest.raises(ValueError, match="fmax"):
        relax(mixed(1), calc, fmax=0)


def test_md_runs_every_structure_its_steps_in_chunks_as_alone(calc, tmp_path):
    from ase import units

    from nvalchemi_ase.md import VelocityVerlet
    from nvalchemi_ase.runners import md

    images = mixed(9, seed=8, largest=30)
    for seed, atoms in enumerate(images):
        rng = np.random.default_rng(seed)
        atoms.set_momenta(rng.normal(0.0, 0.3, (len(atoms), 3)))
    before = _snapshot(images)
    output = tmp_path / "md.extxyz"
    results = md(
        images,
        calc,
        dynamics="VelocityVerlet",
        timestep=2 * units.fs,
        steps=10,
        max_atoms=40,
        output=output,
    )
    assert [int(a.info["index"]) for a in results] == list(range(9))
    for atoms, result in zip(images, results, strict=True):
        copy = atoms.copy()
        copy.calc = calc
        VelocityVerlet(copy, 2 * units.fs, logfile=None).run(10)
        np.testing.assert_allclose(result.positions, copy.positions, atol=1e-10)
        np.testing.assert_allclose(result.get_momenta(), copy.get_momenta(), atol=1e-10)
        assert result.info["failure"] is None
    for atoms, (positions, _, _) in zip(images, before, strict=True):
        assert np.array_equal(atoms.positions, positions)
    assert len(read_results(output)) == 9
    langevin = md(
        images[:3],
        calc,
        timestep=2 * units.fs,
        steps=5,
        temperature_K=50.0,
        friction=0.01 / units.fs,
        seed=1,
    )
    assert all(np.isfinite(a.positions).all() for a in langevin)


def test_resume_drops_a_frame_cut_off_mid_write_and_refuses_silent_overwrite(
    calc, tmp_path
):
    images = mixed(6, seed=9, largest=20)
    output = tmp_path / "cut.extxyz"
    first = list(
        itertools.islice(irelax(images, calc, optimizer="MDMin", output=output), 3)
    )
    text = output.read_text()
    output.write_text(text[: len(text) - 40])  # the last frame loses its tail
    with pytest.raises(FileExistsError, match="resume=True"):
        relax(images, calc, optimizer="MDMin", output=output)
    results = relax(images, calc, optimizer="MDMin", output=output, resume=True)
    assert [int(a.info["index"]) for a in results] == list(range(6))
    assert sorted(int(a.info["index"]) for a in read_results(output)) == list(range(6))
    assert len(first) == 3


# -- what the command line needs: trajectories, cells, stress, series, limits ---------


def test_trajectories_hold_the_frames_each_structure_writes_alone(calc, tmp_path):
    images = mixed(12, seed=10, largest=30)
    results = relax(
        images,
        calc,
        optimizer="MDMin",
        fmax=FMAX,
        max_atoms=50,  # refills: structures join a batch whose others go on
        trajectory=str(tmp_path / "run" / "{i:02d}.traj"),
    )
    for index, atoms in enumerate(images):
        copy = atoms.copy()
        copy.calc = calc
        alone = tmp_path / f"alone_{index}.traj"
        optimize.MDMin(copy, logfile=None, trajectory=str(alone)).run(fmax=FMAX)
        ours = read(tmp_path / "run" / f"{index:02d}.traj", ":")
        theirs = read(alone, ":")
        assert len(ours) == len(theirs) == results[index].info["steps"] + 1
        for mine, reference in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(
                mine.positions, reference.positions, atol=PATH_ATOL, rtol=0
            )
            assert mine.get_potential_energy() == pytest.approx(
                reference.get_potential_energy(), abs=1e-10
            )


def _strained_cells(count: int) -> list[Atoms]:
    rng = np.random.default_rng(0)
    images = []
    for k in range(count):
        atoms = bulk("Ar", "fcc", a=A_AR * (1 + 0.03 * rng.uniform(-1, 1)))
        atoms = atoms * (2, 1, 1 + k % 2)
        atoms.rattle(0.05, seed=k)
        images.append(atoms)
    return images


@pytest.mark.parametrize("optimizer", ["FIRE2", "LBFGS", "FIRE", "BFGS", "MDMin"])
def test_cell_filter_relaxes_every_cell_as_alone(calc, optimizer):
    from ase.filters import FrechetCellFilter

    # In-flight refills would move a variable-cell survivor by ~1e-5 Å (its
    # cell degrees of freedom are relative to the cell it started from), so
    # with a cell filter the working batch is refilled only once all finished.
    images = _strained_cells(8)
    results = relax(
        images,
        calc,
        optimizer=optimizer,
        cell_filter=FrechetCellFilter,
        fmax=0.01,
        max_atoms=12,
        properties=("energy", "forces", "stress"),
    )
    fresh = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for atoms, result in zip(images, results, strict=True):
        copy = atoms.copy()
        copy.calc = calc
        opt = getattr(optimize, optimizer)(FrechetCellFilter(copy), logfile=None)
        opt.run(fmax=0.01, steps=1000)
        assert result.info["steps"] == int(opt.converged_at_step[0])
        np.testing.assert_allclose(result.positions, copy.positions, atol=1e-10)
        np.testing.assert_allclose(result.cell.array, copy.cell.array, atol=1e-10)
        check = result.copy()
        check.calc = fresh
        np.testing.assert_allclose(result.get_stress(), check.get_stress(), atol=1e-12)


def test_stress_is_kept_for_cells_of_rank_three_only(calc):
    images = mixed(8, seed=11, largest=30)
    results = relax(
        images,
        calc,
        optimizer="MDMin",
        fmax=FMAX,
        max_atoms=50,
        properties=("energy", "forces", "stress"),
    )
    fresh = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for result in results:
        if result.cell.rank < 3:
            assert "stress" not in result.calc.results
            continue
        check = result.copy()
        check.calc = fresh
        np.testing.assert_allclose(result.get_stress(), check.get_stress(), atol=1e-12)
    assert any(r.cell.rank < 3 for r in results)
    assert any(r.cell.rank == 3 for r in results)


def test_series_hold_each_structures_own_steps(calc):
    images = mixed(10, seed=12, largest=30)
    series = {}
    results = relax(
        images, calc, optimizer="MDMin", fmax=FMAX, max_atoms=50, series=series
    )
    assert sorted(series) == list(range(10))
    fresh = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    for index, result in enumerate(results):
        values = series[index]
        assert len(values["fmax"]) == len(values["epot_per_atom"])
        assert len(values["fmax"]) == result.info["steps"] + 1
        start = images[index].copy()
        start.calc = fresh
        initial = np.linalg.norm(start.get_forces(), axis=1).max()
        assert values["fmax"][0] == pytest.approx(initial, abs=1e-10)
        final = np.linalg.norm(result.get_forces(), axis=1).max()
        assert values["fmax"][-1] == pytest.approx(final, abs=1e-10)
        assert values["epot_per_atom"][-1] * len(result) == pytest.approx(
            result.get_potential_energy(), abs=1e-10
        )


def test_max_structures_caps_the_working_batch(calc):
    stream = Counting(mixed(30, seed=13, largest=10))
    largest = 0
    for count, _ in enumerate(
        irelax(
            stream,
            calc,
            optimizer="MDMin",
            fmax=FMAX,
            max_atoms=10_000,
            max_structures=3,
        ),
        start=1,
    ):
        largest = max(largest, stream.pulled - count)
    assert largest <= 3 + 1  # one read ahead
    assert largest >= 2


def test_structures_the_model_cannot_run_fail_alone(calc):
    images = mixed(6, seed=14, largest=20)
    broken = images[1].copy()
    broken.positions[0, 0] = np.nan
    images.insert(2, broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = relax(images, calc, optimizer="MDMin", fmax=FMAX)
    assert "positions" in results[2].info["failure"]
    assert "not finite" in results[2].info["failure"]
    assert all(r.info["converged"] for i, r in enumerate(results) if i != 2)


def _raising_after(model, calls: int, error: Exception):
    original = model.forward
    seen = {"n": 0}

    def forward(batch, *args, **kwargs):
        seen["n"] += 1
        if seen["n"] >= calls:
            raise error
        return original(batch, *args, **kwargs)

    model.forward = forward
    return lambda: model.__dict__.pop("forward", None)


def test_an_error_in_the_working_batch_names_its_inputs():
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    images = mixed(10, seed=15, largest=30)
    sizes = np.cumsum([len(a) for a in images])
    first_batch = int((sizes <= 50).sum())  # admitted in input order while they fit
    undo = _raising_after(calc.model, 3, RuntimeError("model broke for graph 1"))
    try:
        with pytest.raises(RuntimeError, match="graph 1") as raised:
            list(irelax(images, calc, optimizer="MDMin", fmax=1e-6, max_atoms=50))
    finally:
        undo()
    assert raised.value.input_indices == tuple(range(first_batch))

    undo = _raising_after(calc.model, 2, RuntimeError("model broke"))
    try:
        with pytest.raises(RuntimeError) as raised:
            list(isingle_points(images, calc, max_atoms=50))
    finally:
        undo()
    second_chunk = int((sizes <= 50 + sizes[first_batch - 1]).sum())
    assert raised.value.input_indices == tuple(range(first_batch, second_chunk))


def test_single_points_resumed_write_the_uninterrupted_file(calc, tmp_path):
    images = mixed(12, seed=16, largest=30)
    full = tmp_path / "full.extxyz"
    single_points(images, calc, max_atoms=60, output=full)
    part = tmp_path / "part.extxyz"
    run = isingle_points(images, calc, max_atoms=60, output=part)
    first = list(itertools.islice(run, 5))  # likely mid-chunk: it runs again whole
    run.close()
    assert set(finished_indices(part)) == {index for index, _ in first}
    results = single_points(images, calc, max_atoms=60, output=part, resume=True)
    assert [int(a.info["index"]) for a in results] == list(range(12))
    assert part.read_text() == full.read_text()  # the same chunks, every digit


def test_md_resumed_writes_the_uninterrupted_seeded_langevin_run(calc, tmp_path):
    from ase import units

    images = mixed(9, seed=17, largest=30)
    settings = {
        "dynamics": "Langevin",
        "timestep": 2 * units.fs,
        "steps": 8,
        "temperature_K": 60.0,
        "friction": 0.01 / units.fs,
        "seed": 3,
        "max_atoms": 40,
        "loginterval": 2,
    }
    full = tmp_path / "full.extxyz"
    md(
        images,
        calc,
        output=full,
        trajectory=str(tmp_path / "full_{i}.traj"),
        **settings,
    )
    part = tmp_path / "part.extxyz"
    run = imd(
        images,
        calc,
        output=part,
        trajectory=str(tmp_path / "part_{i}.traj"),
        **settings,
    )
    first = list(itertools.islice(run, 4))
    run.close()
    assert len(first) == 4
    md(
        images,
        calc,
        output=part,
        resume=True,
        trajectory=str(tmp_path / "part_{i}.traj"),
        **settings,
    )
    assert part.read_text() == full.read_text()
    for index in range(len(images)):
        ours = read(tmp_path / f"part_{index}.traj", ":")
        reference = read(tmp_path / f"full_{index}.traj", ":")
        assert len(ours) == len(reference) == 5
        for mine, theirs in zip(ours, reference, strict=True):
            assert np.array_equal(mine.positions, theirs.positions)
            assert np.array_equal(mine.get_momenta(), theirs.get_momenta())


def _md_settings():
    from ase import units

    return {
        "dynamics": "Langevin",
        "timestep": 2 * units.fs,
        "steps": 12,
        "temperature_K": 60.0,
        "friction": 0.01 / units.fs,
        "seed": 3,
        "max_atoms": 40,
        "loginterval": 2,
        "restart_interval": 5,
    }


def _stop_after(calls: int):
    """A ``stop=`` that asks for a stop at its ``calls``-th question."""
    asked = itertools.count(1)
    return lambda: next(asked) == calls


def test_md_stopped_mid_chunk_restarts_to_the_uninterrupted_run(calc, tmp_path):
    images = mixed(9, seed=17, largest=30)
    full = tmp_path / "full.extxyz"
    md(
        images,
        calc,
        output=full,
        trajectory=str(tmp_path / "full_{i}.traj"),
        **_md_settings(),
    )
    part, checkpoint = tmp_path / "part.extxyz", tmp_path / "ck.npz"
    arguments = {
        "output": part,
        "trajectory": str(tmp_path / "part_{i}.traj"),
        "restart": checkpoint,
        **_md_settings(),
    }
    # asked before each chunk, then after steps 0-11 of it: the second chunk
    # stops at step 8 (frames 0-8 written, past its checkpoint of step 5)
    with pytest.raises(RunStopped) as stopped:
        list(imd(images, calc, stop=_stop_after(13 + 1 + 9), **arguments))
    assert stopped.value.step == 8
    assert stopped.value.checkpoint == checkpoint
    written = finished_indices(part)
    assert sorted(written) == list(range(len(written)))  # the first chunk
    assert not set(stopped.value.input_indices) & set(written)
    assert checkpoint.exists()

    results = md(images, calc, **arguments)  # continues: resume=True implied
    assert not checkpoint.exists()
    assert part.read_text() == full.read_text()
    assert [int(a.info["index"]) for a in results] == list(range(len(images)))
    for index in range(len(images)):
        ours = read(tmp_path / f"part_{index}.traj", ":")
        reference = read(tmp_path / f"full_{index}.traj", ":")
        assert len(ours) == len(reference) == 7
        for mine, theirs in zip(ours, reference, strict=True):
            assert np.array_equal(mine.positions, theirs.positions)
            assert np.array_equal(mine.get_momenta(), theirs.get_momenta())


def test_md_checkpoint_of_a_written_chunk_is_dropped_another_refused(calc, tmp_path):
    from nvalchemi_ase.dynamics.checkpoint import CheckpointError

    images = mixed(6, seed=19, largest=30)
    part, checkpoint = tmp_path / "part.extxyz", tmp_path / "ck.npz"
    arguments = {"output": part, "restart": checkpoint, **_md_settings()}
    with pytest.raises(RunStopped):  # the second chunk, at step 3
        list(imd(images, calc, stop=_stop_after(13 + 1 + 4), **arguments))
    kept = checkpoint.read_bytes()
    first = sorted(finished_indices(part))

    # as if killed after the second chunk's results, before the file's removal
    md(images, calc, **{**arguments, "restart": tmp_path / "other.npz"}, resume=True)
    stale = part.read_text()
    checkpoint.write_bytes(kept)
    md(images, calc, **arguments)  # nothing left to run: the file is dropped
    assert not checkpoint.exists()
    assert part.read_text() == stale

    # a checkpoint of a chunk that is not the one in flight is refused
    part.write_text(frames_by_index(part)[first[0]])  # the first chunk in flight
    checkpoint.write_bytes(kept)
    with pytest.raises(CheckpointError, match="extra/tag/input_indices"):
        md(images, calc, **arguments)


def test_md_failure_reports_the_step_it_failed_at(calc):
    from ase import units

    images = mixed(3, seed=18, largest=20)
    for atoms in images:
        atoms.set_momenta(np.zeros((len(atoms), 3)))
    bad = bulk("Ar", "fcc", a=A_AR) * (2, 1, 1)
    towards = bad.positions[1] - bad.positions[0]
    momenta = np.zeros((2, 3))
    momenta[0] = (
        bad.get_masses()[0] * (4.0 / units.fs) * towards / np.linalg.norm(towards)
    )
    bad.set_momenta(momenta)
    images.insert(1, bad)
    results = md(
        images, calc, dynamics="VelocityVerlet", timestep=1 * units.fs, steps=10
    )
    failed = results[1]
    assert failed.info["failure"] is not None
    assert 1 <= failed.info["steps"] < 10
    assert np.isfinite(failed.positions).all()
    assert [r.info["steps"] for i, r in enumerate(results) if i != 1] == [10, 10, 10]


def test_resume_drops_a_frame_cut_inside_its_last_line(calc, tmp_path):
    images = mixed(6, seed=19, largest=20)
    full = tmp_path / "full.extxyz"
    relax(images, calc, optimizer="MDMin", output=full)
    output = tmp_path / "cut.extxyz"
    list(itertools.islice(irelax(images, calc, optimizer="MDMin", output=output), 3))
    text = output.read_text()
    output.write_text(text[:-2])  # the last number loses a digit and its newline
    assert len(finished_indices(output)) == 2
    relax(images, calc, optimizer="MDMin", output=output, resume=True)
    assert frames_by_index(output) == frames_by_index(full)


def test_sort_output_orders_frames_by_index_keeping_their_text(calc, tmp_path):
    output = tmp_path / "out.extxyz"
    images = mixed(10, seed=20, largest=30)
    order = [
        i
        for i, _ in irelax(images, calc, optimizer="MDMin", max_atoms=40, output=output)
    ]
    assert order != sorted(order)
    before = frames_by_index(output)
    sort_output(output)
    assert [int(a.info["index"]) for a in iread(output, index=":")] == list(range(10))
    assert frames_by_index(output) == before
    assert output.read_text() == "".join(before[i] for i in range(10))


@pytest.mark.slow  # 5000 frames read, evaluated and written
def test_five_thousand_frames_stream_with_memory_bounded_by_the_chunk(calc, tmp_path):
    import weakref

    count, chunk = 5000, 250
    path = tmp_path / "many.extxyz"
    rng = np.random.default_rng(0)
    write(
        path,
        (
            Atoms("Ar2", positions=[[0, 0, 0], [0, 0, 3.6 + 0.4 * rng.random()]])
            for _ in range(count)
        ),
        format="extxyz",
    )
    alive = {"now": 0, "most": 0}

    def released() -> None:
        alive["now"] -= 1

    def frames():
        for atoms in iread(path, index=":"):
            alive["now"] += 1
            alive["most"] = max(alive["most"], alive["now"])
            weakref.finalize(atoms, released)
            yield atoms

    output = tmp_path / "out.extxyz"
    done = 0
    for done, (index, atoms) in enumerate(
        isingle_points(frames(), calc, max_structures=chunk, output=output), start=1
    ):
        assert index == done - 1  # input order
        distance = atoms.get_distance(0, 1)
        energy = 4 * 0.0104 * ((3.40 / distance) ** 12 - (3.40 / distance) ** 6)
        assert atoms.get_potential_energy() == pytest.approx(energy, rel=1e-10)
        del atoms
    assert done == count
    # one chunk in flight and the next being read, never the file
    assert alive["most"] <= 2 * chunk + 1
    assert len(finished_indices(output)) == count


def test_progress_reports_structures_converged_failed_and_rate(calc, capsys):
    images = mixed(6, largest=12)
    images.append(bulk("Ar", "fcc", a=A_AR) * (5, 5, 4))  # over the budget: fails
    results = relax(
        images, calc, optimizer="FIRE", fmax=FMAX, max_atoms=60, progress=True
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    failed = sum(a.info["failure"] is not None for a in results)
    assert failed == 1
    assert last.startswith("relax: 7/7 structures")
    assert "structures/s" in last or "s/structure" in last
    assert f"converged {sum(a.info['converged'] for a in results)}, failed 1" in last


def test_refill_steps_is_checked_and_changes_no_path(calc):
    images = mixed(12, seed=23, largest=30)
    with pytest.raises(ValueError, match="refill_steps"):
        relax(images, calc, refill_steps=-1.0)
    eager = relax(images, calc, fmax=FMAX, max_atoms=60, refill_steps=0.0)
    lazy = relax(images, calc, fmax=FMAX, max_atoms=60, refill_steps=50.0)
    for a, b in zip(eager, lazy, strict=True):
        assert a.info["steps"] == b.info["steps"]
        np.testing.assert_allclose(a.positions, b.positions, atol=PATH_ATOL)
