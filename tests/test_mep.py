"""Nudged elastic bands: ``mep.NEB`` equals ASE's; ``relax_paths`` runs many paths.

LJ argon in float64 throughout: a vacancy hop on the surface of a 32-atom
cluster for the step-by-step comparisons (cheap: no periodic images), and for
``relax_paths`` adatom hops on fcc(100) slabs and vacancy hops in bulk cells of
several sizes.
"""

from __future__ import annotations

import contextlib
import csv
import time

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import add_adsorbate, bulk, fcc100
from ase.constraints import FixAtoms
from ase.io import read
from ase.io.trajectory import Trajectory
from ase.mep import NEB as ASENEB
from ase.mep import NEBTools, interpolate
from ase.optimize import BFGS, FIRE

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.cli.main import main
from nvalchemi_ase.mep import NEB, PathResult, relax_paths
from nvalchemi_ase.optimize import FIRE as BatchedFIRE

ARGON_A = 5.26  # Å
EXACT_POSITIONS = 1e-8  # Å, after N optimizer steps (float64)
BARRIER_TOLERANCE = 1e-3  # eV, relax_paths vs ASE's NEB + FIRE to the same fmax


# -- structures -----------------------------------------------------------------------


def cluster_hop() -> tuple[Atoms, Atoms]:
    """A surface vacancy of a 32-atom argon cube and a neighbour hopping into it."""
    cube = bulk("Ar", "fcc", a=ARGON_A, cubic=True).repeat(2)
    cube.pbc = False
    cube.cell = np.zeros((3, 3))
    centre = cube.positions.mean(axis=0)
    distance = np.linalg.norm(cube.positions - centre, axis=1)
    vacancy = int(np.argmin(np.abs(distance - np.sort(distance)[-9])))  # a face site
    gaps = np.linalg.norm(cube.positions - cube.positions[vacancy], axis=1)
    gaps[vacancy] = np.inf
    hopper = int(np.argmin(gaps))
    initial = cube.copy()
    final = cube.copy()
    final.positions[hopper] = cube.positions[vacancy]
    del initial[vacancy]
    del final[vacancy]
    return initial, final


def band(initial: Atoms, final: Atoms, n_images: int, calc) -> list[Atoms]:
    images = [initial.copy() for _ in range(n_images - 1)] + [final.copy()]
    interpolate(images, mic=True)
    for image in images:
        image.calc = calc
    return images


def vacancy_hop(repeat: tuple[int, int, int]) -> tuple[Atoms, Atoms]:
    """Bulk fcc argon with a vacancy at atom 0 and its neighbour 1 hopping in."""
    crystal = bulk("Ar", "fcc", a=ARGON_A, cubic=True).repeat(repeat)
    initial, final = crystal.copy(), crystal.copy()
    final.positions[1] = crystal.positions[0]
    del initial[0]
    del final[0]
    return initial, final


def adatom_hop(size: tuple[int, int, int]) -> tuple[Atoms, Atoms]:
    """An argon adatom hopping between neighbouring hollows of fcc(100)."""
    slab = fcc100("Ar", size=size, a=ARGON_A, vacuum=7.0)
    slab.set_constraint(FixAtoms(mask=slab.get_tags() == size[2]))  # bottom layer
    initial, final = slab.copy(), slab.copy()
    add_adsorbate(initial, "Ar", ARGON_A / 2, "hollow")
    add_adsorbate(final, "Ar", ARGON_A / 2, "hollow", offset=(1, 0))
    return initial, final


def relaxed_endpoints(pairs, calc, fmax=0.002):
    endpoints = [atoms for pair in pairs for atoms in pair]
    for atoms in endpoints:
        atoms.calc = calc
    BatchedFIRE(endpoints, logfile=None).run(fmax=fmax, steps=2000)
    return pairs


def max_shift(first: list[Atoms], second: list[Atoms]) -> float:
    return max(
        float(np.abs(a.positions - b.positions).max())
        for a, b in zip(first, second, strict=True)
    )


def one_blas_thread():
    """BFGS's eigh on a loaded machine: multithreaded OpenBLAS spins (100x slower)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scipy's stack
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


@pytest.fixture(scope="module")
def hop():
    return cluster_hop()


# -- mep.NEB: ASE's NEB, one model call per evaluation --------------------------------


CASES = [
    ("aseneb", False, FIRE),
    ("aseneb", True, FIRE),
    ("improvedtangent", False, FIRE),
    ("improvedtangent", True, FIRE),
    ("aseneb", True, BFGS),
    ("improvedtangent", True, BFGS),
]


@pytest.mark.parametrize(
    ("method", "climb", "optimizer"),
    CASES,
    ids=[f"{m}-{'climb' if c else 'plain'}-{o.__name__}" for m, c, o in CASES],
)
def test_neb_follows_ase_step_for_step(hop, lj_calc64, method, climb, optimizer):
    steps = 10
    theirs = band(*hop, 5, lj_calc64)
    ours = band(*hop, 5, lj_calc64)
    ase_neb = ASENEB(theirs, climb=climb, method=method, allow_shared_calculator=True)
    neb = NEB(ours, climb=climb, method=method)
    with one_blas_thread():
        optimizer(ase_neb, logfile=None).run(fmax=1e-6, steps=steps)
        optimizer(neb, logfile=None).run(fmax=1e-6, steps=steps)
    assert max_shift(theirs, ours) < EXACT_POSITIONS
    assert neb.imax == ase_neb.imax
    np.testing.assert_allclose(neb.energies[1:-1], ase_neb.energies[1:-1], atol=1e-10)
    assert abs(neb.get_residual() - ase_neb.get_residual()) < 1e-8
    # every image keeps its own results, as with ASE's NEB
    assert len({id(image.calc) for image in ours[1:-1]}) == len(ours) - 2
    for a, b in zip(theirs, ours, strict=True):
        assert abs(a.get_potential_energy() - b.get_potential_energy()) < 1e-10
    assert NEBTools(ours).get_barrier() == pytest.approx(
        NEBTools(theirs).get_barrier(), abs=1e-9
    )


def test_neb_with_rotation_removal_follows_ase(hop, lj_calc64):
    theirs = band(*hop, 5, lj_calc64)
    ours = band(*hop, 5, lj_calc64)
    for image in theirs[1:-1] + ours[1:-1]:
        image.rattle(0.05, seed=1)
    options = {"climb": True, "method": "improvedtangent"}
    ase_neb = ASENEB(
        theirs,
        remove_rotation_and_translation=True,
        allow_shared_calculator=True,
        **options,
    )
    neb = NEB(ours, remove_rotation_and_translation=True, **options)
    FIRE(ase_neb, logfile=None).run(fmax=1e-6, steps=8)
    FIRE(neb, logfile=None).run(fmax=1e-6, steps=8)
    assert max_shift(theirs, ours) < EXACT_POSITIONS
    assert neb.remove_rotation_and_translation


def test_one_model_call_per_force_evaluation(hop):
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    calls = []
    handle = calc.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        ours = band(*hop, 7, calc)
        neb = NEB(ours, climb=True, method="improvedtangent")
        neb.get_forces()
        assert len(calls) == 1  # five interior images and both endpoints
        neb.get_forces()
        assert len(calls) == 1  # nothing moved: everything cached
        FIRE(neb, logfile=None).run(fmax=1e-6, steps=6)
        evaluations = len(calls)
        calls.clear()
        theirs = band(*hop, 7, calc)
        ase_neb = ASENEB(
            theirs, climb=True, method="improvedtangent", allow_shared_calculator=True
        )
        FIRE(ase_neb, logfile=None).run(fmax=1e-6, steps=6)
    finally:
        handle.remove()
    # ASE: both endpoints once, then one call per interior image per evaluation
    assert evaluations == 7
    assert len(calls) == 2 + 5 * evaluations
    assert max_shift(theirs, ours) < EXACT_POSITIONS


def test_trajectory_and_idpp_interpolation_match_ase(hop, lj_calc64, tmp_path):
    theirs = band(*hop, 5, lj_calc64)
    ours = band(*hop, 5, lj_calc64)
    ase_neb = ASENEB(theirs, method="improvedtangent", allow_shared_calculator=True)
    neb = NEB(ours, method="improvedtangent")
    ase_neb.interpolate("idpp", mic=True)
    neb.interpolate("idpp", mic=True)  # IDPP calculators: ASE's own evaluation
    assert max_shift(theirs, ours) < EXACT_POSITIONS
    path = tmp_path / "band.traj"
    with Trajectory(path, "w", neb) as trajectory:
        opt = FIRE(neb, logfile=None)
        opt.attach(trajectory)
        opt.run(fmax=1e-6, steps=3)
    frames = read(path, ":")
    assert len(frames) == 4 * 5  # steps 0-3, five images each
    last = frames[-5:]
    np.testing.assert_allclose(
        [f.get_potential_energy() for f in last[1:-1]], neb.energies[1:-1], atol=1e-12
    )
    np.testing.assert_allclose(last[2].positions, ours[2].positions, atol=1e-12)


def test_other_calculators_are_evaluated_by_ase(hop, lj_calc64):
    from ase.calculators.lj import LennardJones

    images = band(*hop, 5, lj_calc64)
    for image in images:
        image.calc = LennardJones(epsilon=0.0104, sigma=3.4, rc=8.5)
    neb = NEB(images, method="improvedtangent", allow_shared_calculator=False)
    assert neb.evaluate_images() == 0
    forces = neb.get_forces()
    assert forces.shape == (3 * len(images[0]), 3)
    assert np.isfinite(forces).all()


# -- relax_paths: many paths in one batch ---------------------------------------------


@pytest.fixture(scope="module")
def eight_paths(lj_calc64):
    pairs = [
        adatom_hop((3, 3, 3)),
        adatom_hop((4, 3, 3)),
        adatom_hop((4, 4, 3)),
        adatom_hop((3, 3, 4)),
        vacancy_hop((2, 2, 2)),
        vacancy_hop((2, 2, 3)),
        vacancy_hop((3, 2, 2)),
        vacancy_hop((2, 3, 2)),
    ]
    relaxed_endpoints(pairs, lj_calc64)
    counts = [5, 7, 9, 5, 7, 9, 5, 7]
    return [list(pair) for pair in pairs], counts


@pytest.mark.slow
def test_relax_paths_barriers_match_ase_path_by_path(eight_paths, lj_calc64):
    pairs, counts = eight_paths
    fmax = 0.01
    start = time.perf_counter()
    results = relax_paths(
        pairs, lj_calc64, fmax=fmax, n_images=counts, interpolate="linear"
    )
    batched_time = time.perf_counter() - start
    assert all(isinstance(r, PathResult) for r in results)
    assert all(r.converged and not r.failed for r in results)
    differences = []
    for (initial, final), count, result in zip(pairs, counts, results, strict=True):
        images = band(initial, final, count, lj_calc64)
        neb = ASENEB(
            images, climb=True, method="improvedtangent", allow_shared_calculator=True
        )
        assert FIRE(neb, logfile=None).run(fmax=fmax, steps=1000)
        expected, _ = NEBTools(images).get_barrier(fit=False)
        differences.append(result.barrier_forward - expected)
        assert len(result.images) == count
        assert result.fmax < fmax
        assert result.energies.shape == (count,)
        barrier, delta = NEBTools(result.images).get_barrier(fit=False)
        assert barrier == pytest.approx(result.barrier_forward, abs=1e-12)
        assert delta == pytest.approx(result.reaction_energy, abs=1e-12)
    assert np.abs(differences).max() < BARRIER_TOLERANCE, (differences, batched_time)


def test_relax_paths_interpolates_idpp_and_reports_each_path(eight_paths, lj_calc64):
    pairs, counts = eight_paths
    pairs, counts = pairs[::3], counts[::3]  # three paths, both kinds
    results = relax_paths(pairs, lj_calc64, fmax=0.05, n_images=counts)
    for (initial, final), count, result in zip(pairs, counts, results, strict=True):
        assert result.converged, result
        assert len(result.images) == count
        # endpoints kept exactly, fixed atoms kept fixed
        np.testing.assert_array_equal(result.images[0].positions, initial.positions)
        np.testing.assert_array_equal(result.images[-1].positions, final.positions)
        fixed = [c for c in initial.constraints if isinstance(c, FixAtoms)]
        if fixed:
            index = fixed[0].get_indices()
            for image in result.images:
                np.testing.assert_array_equal(
                    image.positions[index], initial.positions[index]
                )
        energies = [image.get_potential_energy() for image in result.images]
        np.testing.assert_allclose(energies, result.energies, atol=1e-12)
        # the stored results (the engine batch's last evaluation) are a fresh
        # evaluation's of the final images
        fresh = lj_calc64.calculate_batch(result.images)
        np.testing.assert_allclose(
            energies, [entry["energy"] for entry in fresh], rtol=0, atol=1e-10
        )
        for image, entry in zip(result.images, fresh, strict=True):
            np.testing.assert_allclose(
                image.get_forces(apply_constraint=False),
                entry["forces"],
                rtol=0,
                atol=1e-10,
            )
        assert 0 < result.highest_image < count - 1
        assert result.barrier_forward > 0.0
        assert result.barrier_reverse == pytest.approx(
            result.energies.max() - result.energies[-1]
        )
    assert all(result.images[0].calc is not None for result in results)


def test_relax_paths_batches_whole_paths_within_the_memory_budget(
    eight_paths, lj_calc64, monkeypatch
):
    from nvalchemi_ase.mep import engine

    pairs, counts = eight_paths
    pairs, counts = pairs[3:6], [5, 7, 5]  # a slab and two bulk cells
    batches = []
    original = engine.run_neb
    monkeypatch.setattr(
        "nvalchemi_ase.mep.paths.run_neb",
        lambda bands, *a, **k: batches.append(len(bands)) or original(bands, *a, **k),
    )
    together = relax_paths(pairs, lj_calc64, fmax=0.05, n_images=counts)
    assert batches == [3]
    batches.clear()
    budget = sum(n * len(pair[0]) for pair, n in zip(pairs[:2], counts, strict=False))
    apart = relax_paths(pairs, lj_calc64, fmax=0.05, n_images=counts, max_atoms=budget)
    assert batches == [2, 1]  # whole paths, in input order
    with pytest.raises(ValueError, match="max_atoms"):
        relax_paths(pairs, lj_calc64, n_images=counts, max_atoms=0)
    for one, other in zip(together, apart, strict=True):
        assert one.converged
        assert other.converged
        assert one.steps == other.steps
        assert one.barrier_forward == pytest.approx(other.barrier_forward, abs=1e-10)
        assert max_shift(one.images, other.images) < 1e-8


def neighbours_per_image(calc, images: int):
    """Record, per model call on the whole band batch, each image's neighbour count."""
    forward = calc.model.forward
    counts: list[torch.Tensor] = []

    def counting_forward(data, **kwargs):
        if data.num_graphs == images:
            per_image = torch.zeros(images, dtype=torch.long)
            per_image.index_add_(0, data.batch_idx.long(), data.num_neighbors.long())
            counts.append(per_image)
        return forward(data, **kwargs)

    calc.model.forward = counting_forward
    return counts


def test_relax_paths_evaluates_endpoints_once_and_converged_paths_no_more(
    eight_paths, monkeypatch
):
    from nvalchemi_ase.mep import engine
    from nvalchemi_ase.mep.settled import SettledImages

    pairs, counts = eight_paths
    pairs, counts = [pairs[0], pairs[6]], [7, 5]  # a slab and a bulk cell
    images = sum(counts)
    budget = images * max(len(pair[0]) for pair in pairs)  # one batch, no probe
    run = {"paths": pairs, "fmax": 0.01, "n_images": counts, "max_atoms": budget}
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    calls = neighbours_per_image(calc, images)
    try:
        results = relax_paths(**run, model=calc, interpolate="linear")
    finally:
        del calc.model.forward

    # the reference: the same run evaluating every image at every step
    class EveryImage(SettledImages):
        def _empty(self, batch, graphs):
            pass

    monkeypatch.setattr(engine, "SettledImages", EveryImage)
    reference_calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    full = neighbours_per_image(reference_calc, images)
    try:
        reference = relax_paths(**run, model=reference_calc, interpolate="linear")
    finally:
        del reference_calc.model.forward

    steps = [result.steps for result in results]
    assert steps == [result.steps for result in reference]
    assert len(set(steps)) == 2  # one path converges first (26 and 27 steps)
    # one call per step after the first evaluation, none after the run
    assert len(calls) == len(full) == max(steps) + 1
    assert all(bool((count > 0).all()) for count in full)
    endpoint = torch.zeros(images, dtype=torch.bool)
    endpoint[[0, counts[0] - 1, counts[0], images - 1]] = True
    path_of = torch.repeat_interleave(torch.arange(2), torch.tensor(counts))
    assert bool((calls[0] > 0).all())  # every image once
    for step, count in enumerate(calls[1:], start=1):
        assert not count[endpoint].any(), step
        running = torch.tensor([step <= s for s in steps])[path_of] & ~endpoint
        assert bool((count[running] > 0).all()), step
        assert not count[~running].any(), step  # converged paths: no work
    # and the numbers are those of evaluating every image
    for result, expected in zip(results, reference, strict=True):
        assert result.converged
        assert expected.converged
        assert max_shift(result.images, expected.images) < EXACT_POSITIONS
        np.testing.assert_allclose(
            result.energies, expected.energies, rtol=0, atol=1e-12
        )
        for image, other in zip(result.images, expected.images, strict=True):
            np.testing.assert_allclose(
                image.get_forces(apply_constraint=False),
                other.get_forces(apply_constraint=False),
                rtol=0,
                atol=1e-12,
            )


def test_one_failing_path_stops_alone(eight_paths, lj_calc64):
    pairs, counts = eight_paths
    pairs, counts = [pairs[4], pairs[5], pairs[0]], [5, 5, 5]
    poisoned = len(pairs[1][0])  # atoms in the second path only
    assert sum(len(pair[0]) == poisoned for pair in pairs) == 1
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    forward = calc.model.forward
    evaluations = []

    def poisoned_forward(data, **kwargs):
        out = forward(data, **kwargs)
        evaluations.append(1)
        if len(evaluations) > 3:
            bad = (data.num_nodes_per_graph == poisoned)[data.batch_idx.long()]
            out["forces"] = torch.where(bad[:, None], torch.nan, out["forces"])
        return out

    calc.model.forward = poisoned_forward
    try:
        results = relax_paths(
            pairs, calc, fmax=0.05, n_images=counts, interpolate="linear"
        )
    finally:
        del calc.model.forward
    healthy = relax_paths(
        [pairs[0], pairs[2]], lj_calc64, fmax=0.05, n_images=5, interpolate="linear"
    )
    failed = results[1]
    assert failed.failed
    assert not failed.converged
    assert "non-finite" in failed.failure
    assert failed.steps == 3
    assert all(np.isfinite(image.positions).all() for image in failed.images)
    for result, alone in zip([results[0], results[2]], healthy, strict=True):
        assert result.converged
        assert not result.failed
        assert result.barrier_forward == pytest.approx(alone.barrier_forward, abs=1e-9)


def test_relax_paths_runs_clusters_whose_extent_changes_along_the_path(lj_calc64):
    # an adatom rolling over an edge of a cube: the images' bounding boxes differ,
    # so their stand-in cells in the batch would too
    cube = bulk("Ar", "fcc", a=ARGON_A, cubic=True).repeat(2)
    cube.pbc = False
    cube.cell = np.zeros((3, 3))
    top, edge = cube.positions[:, 2].max(), cube.positions[:, 0].max()
    initial, final = cube + Atoms("Ar"), cube + Atoms("Ar")
    initial.positions[-1] = [ARGON_A / 2, ARGON_A, top + ARGON_A / 2]
    final.positions[-1] = [edge + ARGON_A / 2, ARGON_A, top - ARGON_A / 2]
    relaxed_endpoints([(initial, final)], lj_calc64)
    (result,) = relax_paths(
        [[initial, final]], lj_calc64, n_images=5, steps=20, interpolate="idpp"
    )
    assert not result.failed
    assert np.isfinite(result.energies).all()
    assert all(not image.cell.any() for image in result.images)


def test_relax_paths_refuses_bad_input(hop, lj_calc64):
    initial, final = hop
    with pytest.raises(ValueError, match="n_images"):
        relax_paths([[initial, final]], lj_calc64)
    with pytest.raises(ValueError, match="method"):
        relax_paths([[initial, final]], lj_calc64, n_images=5, method="aseneb")
    with pytest.raises(ValueError, match="atoms differ"):
        relax_paths([[initial, final[:-1]]], lj_calc64, n_images=5)
    with pytest.raises(ValueError, match="interpolate"):
        relax_paths([[initial, final]], lj_calc64, n_images=5, interpolate="spline")


# -- command line ---------------------------------------------------------------------


def test_cli_neb_writes_bands_barriers_and_plot(tmp_path, capsys):
    from ase.io import write

    pairs = [vacancy_hop((2, 2, 2)), adatom_hop((3, 3, 3))]
    for k, (initial, final) in enumerate(pairs):
        initial.info.clear()  # fcc100's adsorbate_info is not extxyz data
        final.info.clear()
        write(tmp_path / f"initial{k}.extxyz", initial)
        write(tmp_path / f"final{k}.extxyz", final)
    prefix = tmp_path / "out" / "hops"
    argv = [
        "neb",
        "--initial",
        str(tmp_path / "initial0.extxyz"),
        str(tmp_path / "initial1.extxyz"),
        "--final",
        str(tmp_path / "final0.extxyz"),
        str(tmp_path / "final1.extxyz"),
        "--n-images",
        "5",
        "--interpolate",
        "linear",
        "--steps",
        "4",
        "--prefix",
        str(prefix),
        "--model",
        "lj",
        "--device",
        "cpu",
        "--dtype",
        "float64",
    ]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "Ef/eV" in shown
    assert "0/2 paths converged" in shown
    for k in range(2):
        frames = read(tmp_path / "out" / f"hops-band-{k:03d}.extxyz", ":")
        assert len(frames) == 5
        assert [f.info["image"] for f in frames] == list(range(5))
        assert np.isfinite([f.get_potential_energy() for f in frames]).all()
    with open(tmp_path / "out" / "hops-barriers.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["path"] for row in rows] == ["0", "1"]
    assert all(float(row["barrier_forward_eV"]) > 0 for row in rows)
    assert all(row["converged"] == "NO" and row["steps"] == "4" for row in rows)
    png = (tmp_path / "out" / "hops-bands.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(argv) == 2  # outputs exist: refused without --overwrite
    assert "--overwrite" in capsys.readouterr().err
