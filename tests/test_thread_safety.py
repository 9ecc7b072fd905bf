"""Calculators and models shared between threads; calculators sent to processes.

Every result computed concurrently is compared with a serial reference
computed beforehand, structure by structure: zero wrong results allowed.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
import threading
from collections.abc import Callable

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.models import load_model
from nvalchemi_ase.models.locks import model_lock

THREADS = 8
CALLS = 25
# The same float64 code path evaluates the same structure: the numbers agree to
# rounding of summation order at most.
ENERGY_TOL = 1e-9  # eV
FORCE_TOL = 1e-9  # eV/Å


def _structures() -> list[Atoms]:
    """Eight argon cells of 4, 8 and 12 atoms, each rattled differently."""
    structures = []
    for k in range(THREADS):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((1, 1, 1 + k % 3))
        atoms.rattle(0.05, seed=k)
        structures.append(atoms)
    return structures


@pytest.fixture(scope="module")
def structures() -> list[Atoms]:
    return _structures()


@pytest.fixture(scope="module")
def reference(structures: list[Atoms]) -> list[dict[str, np.ndarray]]:
    """Serial results, one calculator per structure (nothing shared)."""
    results = []
    for atoms in structures:
        copy = atoms.copy()
        copy.calc = NVAlchemiCalculator("lj", device="cpu")
        results.append(
            {"energy": copy.get_potential_energy(), "forces": copy.get_forces()}
        )
    return results


def _in_threads(worker: Callable[[int], int]) -> list[int]:
    """Run ``worker(k)`` for k < THREADS at once; each returns its wrong results."""
    barrier = threading.Barrier(THREADS)

    def start(k: int) -> int:
        barrier.wait()  # every thread enters the calculator together
        return worker(k)

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(start, range(THREADS)))


def _is_right(energy: float, forces: np.ndarray, expected: dict) -> bool:
    return (
        abs(energy - expected["energy"]) < ENERGY_TOL
        and forces.shape == expected["forces"].shape
        and np.allclose(forces, expected["forces"], rtol=0, atol=FORCE_TOL)
    )


def _asking_worker(
    calculator_for: Callable[[int], NVAlchemiCalculator],
    structures: list[Atoms],
    reference: list[dict],
) -> Callable[[int], int]:
    def worker(k: int) -> int:
        calc = calculator_for(k)
        wrong = 0
        for call in range(CALLS):
            atoms = structures[k].copy()  # a new Atoms every call: no cache hit
            atoms.calc = calc
            if call % 2:
                wrong += not _is_right(
                    atoms.get_potential_energy(), atoms.get_forces(), reference[k]
                )
            else:
                forces = atoms.get_forces()
                wrong += not _is_right(
                    atoms.get_potential_energy(), forces, reference[k]
                )
        return wrong

    return worker


def test_one_calculator_shared_by_threads(structures, reference):
    shared = NVAlchemiCalculator(load_model("lj"), device="cpu")
    worker = _asking_worker(lambda k: shared, structures, reference)
    assert _in_threads(worker) == [0] * THREADS


def test_one_calculator_per_thread_over_one_model(structures, reference):
    model = load_model("lj")
    calculators = [NVAlchemiCalculator(model, device="cpu") for _ in range(THREADS)]
    assert all(calc.model is model for calc in calculators)  # really shared
    worker = _asking_worker(lambda k: calculators[k], structures, reference)
    assert _in_threads(worker) == [0] * THREADS


def test_calculate_batch_from_threads(structures, reference):
    shared = NVAlchemiCalculator(load_model("lj"), device="cpu")

    def worker(k: int) -> int:
        wrong = 0
        for call in range(CALLS):
            picked = [(k + j) % THREADS for j in range(1 + call % 3)]
            results = shared.calculate_batch([structures[i] for i in picked])
            wrong += sum(
                not _is_right(r["energy"], r["forces"], reference[i])
                for i, r in zip(picked, results, strict=True)
            )
        return wrong

    assert _in_threads(worker) == [0] * THREADS


def test_the_same_model_object_has_one_lock():
    model = load_model("lj")
    other = load_model("lj")
    assert model_lock(model) is model_lock(model)
    assert model_lock(model) is not model_lock(other)
    unhashable: list[int] = []  # neither hashable nor weak-referenceable
    assert model_lock(unhashable) is model_lock(unhashable)


def test_results_stay_with_their_structure_after_threads(structures, reference):
    """Structures sharing one calculator each keep their own results."""
    shared = NVAlchemiCalculator("lj", device="cpu")
    copies = [atoms.copy() for atoms in structures]
    for atoms in copies:
        atoms.calc = shared

    def worker(k: int) -> int:
        return int(
            not _is_right(
                copies[k].get_potential_energy(), copies[k].get_forces(), reference[k]
            )
        )

    assert _in_threads(worker) == [0] * THREADS
    for atoms, expected in zip(copies, reference, strict=True):  # no model call
        assert _is_right(
            atoms.calc.results["energy"], atoms.calc.results["forces"], expected
        )


# -- pickling ---------------------------------------------------------------------


def test_pickled_named_calculator_rebuilds_its_model(structures, reference):
    calc = NVAlchemiCalculator("lj", device="cpu")
    atoms = structures[1].copy()
    atoms.calc = calc
    atoms.get_potential_energy()
    clone = pickle.loads(pickle.dumps(calc))  # noqa: S301 (our own bytes)
    assert clone.model is not calc.model
    assert type(clone.model) is type(calc.model)
    assert clone.results["energy"] == calc.results["energy"]  # results travel
    result = clone.calculate_batch([structures[2]])[0]
    assert _is_right(result["energy"], result["forces"], reference[2])


def test_pickled_calculator_over_a_model_object(structures, reference):
    calc = NVAlchemiCalculator(load_model("lj", epsilon=0.0104), device="cpu")
    clone = pickle.loads(pickle.dumps(calc))  # noqa: S301 (our own bytes)
    result = clone.calculate_batch([structures[0]])[0]
    assert _is_right(result["energy"], result["forces"], reference[0])


def test_unpicklable_model_is_refused_clearly():
    model = load_model("lj")
    model.callback = lambda x: x  # a lambda cannot be pickled
    calc = NVAlchemiCalculator(model, device="cpu")
    with pytest.raises(TypeError, match=r"cannot be pickled.*model name"):
        pickle.dumps(calc)


def _energy_in_worker(calc: NVAlchemiCalculator, atoms: Atoms) -> float:
    atoms = atoms.copy()
    atoms.calc = calc
    return float(atoms.get_potential_energy())


@pytest.mark.slow
def test_process_pool_evaluates_with_a_pickled_calculator(structures, reference):
    """Every task unpickles the calculator anew; one spawned worker takes all
    three (a second would add an interpreter, ~12 s of CPU, and no check)."""
    calc = NVAlchemiCalculator("lj", device="cpu")
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        energies = list(pool.map(_energy_in_worker, [calc] * 3, structures[:3]))
    for energy, expected in zip(energies, reference[:3], strict=True):
        assert abs(energy - expected["energy"]) < ENERGY_TOL
