"""The throughput probe: which batch size it picks, and what the budget does with it.

Timings are never taken here: a fake clock advances by a cost model of the
batch evaluated, so the probe's choice is checked against the optimum of that
model computed independently (no timed test).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase.build import bulk

from nvalchemi_ase import NVAlchemiCalculator
from nvalchemi_ase.runners import Budget, single_points, throughput

#: seconds per call = fixed overhead + per atom + per atom² (a memory-bound model)
MEMORY_BOUND = (0.01, 1e-4, 4e-7)
#: compute-bound: no quadratic term, so larger batches are never slower per atom
COMPUTE_BOUND = (0.01, 1e-4, 0.0)


class FakeClock:
    """Seconds that advance only when the wrapped calculator evaluates a batch."""

    def __init__(
        self,
        coefficients: tuple[float, float, float],
        spikes: dict[int, float] | None = None,
    ) -> None:
        self.now = 0.0
        self.coefficients = coefficients
        self.spikes = spikes or {}  # call number (from 0) -> extra s: a load spike
        self.calls: list[int] = []

    def __call__(self) -> float:
        return self.now

    def charge(self, natoms: int) -> None:
        fixed, linear, quadratic = self.coefficients
        self.now += fixed + linear * natoms + quadratic * natoms**2
        self.now += self.spikes.get(len(self.calls), 0.0)
        self.calls.append(natoms)


def _clocked(calc, clock, monkeypatch):
    """Make ``calc.calculate_batch`` advance ``clock`` by its batch's cost."""
    evaluate = calc.calculate_batch

    def calculate_batch(images, properties=("energy", "forces")):
        images = [images] if hasattr(images, "positions") else list(images)
        clock.charge(sum(len(atoms) for atoms in images))
        return evaluate(images, properties)

    monkeypatch.setattr(calc, "calculate_batch", calculate_batch)


@pytest.fixture
def probing(monkeypatch, tmp_path):
    """The probe switched on, with an empty cache of this test's own."""
    monkeypatch.setenv(throughput.PROBE_ENV, "1")
    monkeypatch.setenv(throughput.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "throughput.json"


@pytest.fixture
def lj_calc():
    return NVAlchemiCalculator("lj", device="cpu", dtype="float64")


def _argon(repeat: int = 3):
    return bulk("Ar", "fcc", a=5.26, cubic=True) * (repeat, repeat, 1)


def _best_doubling_size(natoms: int, coefficients, limit: float) -> int:
    """Atoms of the fastest batch among 1, 2, 4, ... copies, by the cost model."""
    fixed, linear, quadratic = coefficients
    sizes = [natoms * 2**k for k in range(20) if natoms * 2**k <= limit]
    rates = [n / (fixed + linear * n + quadratic * n**2) for n in sizes]
    return sizes[int(np.argmax(rates))]


def test_probe_keeps_to_the_fastest_size_of_a_memory_bound_model(lj_calc, monkeypatch):
    clock = FakeClock(MEMORY_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    sample = _argon()  # 36 atoms
    profile = throughput.probe_throughput(lj_calc, sample, clock=clock)

    expected = _best_doubling_size(
        len(sample), MEMORY_BOUND, throughput.MAX_PROBE_ATOMS
    )
    assert profile.best_atoms == expected
    assert profile.saturated
    assert profile.cap_atoms() == expected
    # it stopped at the first size clearly past the peak, not at the size limit
    slow = (1 - throughput.SLOWDOWN) * max(profile.rates)
    assert profile.rates[-1] < slow
    assert min(profile.rates[:-1]) >= slow or profile.atoms.index(expected) > 0
    assert all(
        rate >= slow for rate in profile.rates[profile.atoms.index(expected) : -1]
    )
    assert profile.atoms[-1] < throughput.MAX_PROBE_ATOMS
    assert profile.seconds == pytest.approx(clock.now)


def test_probe_leaves_a_compute_bound_model_to_the_memory_budget(lj_calc, monkeypatch):
    clock = FakeClock(COMPUTE_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    sample = _argon()
    profile = throughput.probe_throughput(lj_calc, sample, max_atoms=600, clock=clock)

    assert list(profile.rates) == sorted(profile.rates)  # larger is faster
    assert profile.atoms[-1] <= 600 < 2 * profile.atoms[-1]  # stopped at the limit
    assert not profile.saturated
    assert profile.cap_atoms() is None


def test_one_slowed_size_does_not_cap_a_compute_bound_model(lj_calc, monkeypatch):
    # call 0 warms up; calls 1-2 time 1 copy, 3-4 two, 5-6 four, 7-8 eight:
    # both timings of eight copies hit by load, as on a shared machine
    clock = FakeClock(COMPUTE_BOUND, spikes={7: 1.0, 8: 1.0})
    _clocked(lj_calc, clock, monkeypatch)
    sample = _argon()
    profile = throughput.probe_throughput(lj_calc, sample, max_atoms=600, clock=clock)

    assert not profile.saturated  # the spike did not count: eight copies timed again
    assert profile.cap_atoms() is None
    assert list(profile.rates) == sorted(profile.rates)
    assert profile.atoms[-1] <= 600 < 2 * profile.atoms[-1]
    # the best and the slowed size were timed once more, nothing else
    assert clock.calls[9:13] == [4 * len(sample)] * 2 + [8 * len(sample)] * 2


def test_probe_stops_when_its_time_is_spent(lj_calc, monkeypatch):
    clock = FakeClock(COMPUTE_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    profile = throughput.probe_throughput(
        lj_calc, _argon(), max_seconds=0.05, clock=clock
    )
    # the size whose timing crossed the limit is the last one measured
    fixed, linear, _ = COMPUTE_BOUND
    last = throughput.REPEATS * (fixed + linear * profile.atoms[-1])
    assert profile.seconds > 0.05 >= profile.seconds - last
    assert profile.atoms[-1] < throughput.MAX_PROBE_ATOMS


def test_budget_keeps_to_the_probed_size_and_results_are_unchanged(
    lj_calc, probing, monkeypatch
):
    clock = FakeClock(MEMORY_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    structures = [_argon(repeat) for repeat in (3, 2, 3, 4, 3, 2, 3, 3, 2, 3)]

    budget = Budget.for_calculator(lj_calc, None, None)
    memory_only = Budget.for_calculator(lj_calc, None, None, probe=False)
    cost = budget.cost(structures[0])  # the first structure priced is the sample
    expected = _best_doubling_size(len(structures[0]), MEMORY_BOUND, 16384)
    assert budget.profile is not None
    assert not budget.profile.cached
    assert budget.tuned_max_atoms == expected  # LJ's memory grows with atoms
    assert budget.max_atoms is None  # nothing is refused for the tuning
    assert memory_only.fits(np.zeros(4), 20 * cost)  # the memory budget takes 20
    assert not budget.fits(cost * (expected // len(structures[0])), cost)
    huge = cost * (2 * expected // len(structures[0]))  # larger than the tuned size
    assert budget.refusal(huge) is None
    assert budget.fits(np.zeros(4), huge)

    # a run with the tuned budget: chunks within the cap, each structure's own numbers
    evaluated: list[int] = []
    clock.calls.clear()
    results = single_points(structures, lj_calc)
    evaluated = clock.calls
    assert max(evaluated) <= expected
    for atoms, result in zip(structures, results, strict=True):
        alone = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
        reference = atoms.copy()
        reference.calc = alone
        assert result.get_potential_energy() == pytest.approx(
            reference.get_potential_energy(), rel=1e-12, abs=1e-12
        )
        np.testing.assert_allclose(
            result.get_forces(), reference.get_forces(), rtol=0, atol=1e-12
        )


def test_a_second_budget_reads_the_cache_and_does_not_probe(
    lj_calc, probing, monkeypatch
):
    clock = FakeClock(MEMORY_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    first = Budget.for_calculator(lj_calc, None, None)
    first.cost(_argon())
    probe_calls = len(clock.calls)
    assert probe_calls > 0
    assert probing.exists()

    second = Budget.for_calculator(lj_calc, None, None)
    second.cost(_argon())
    assert len(clock.calls) == probe_calls  # no model call
    assert second.profile is not None
    assert second.profile.cached
    assert second.tuned_max_atoms == first.tuned_max_atoms

    # another dtype is another entry
    other = NVAlchemiCalculator("lj", device="cpu", dtype="float32")
    assert throughput.profile_key(other) != throughput.profile_key(lj_calc)
    assert list(json.loads(probing.read_text())) == [throughput.profile_key(lj_calc)]


def test_given_counts_and_the_switch_turn_the_probe_off(lj_calc, probing, monkeypatch):
    clock = FakeClock(MEMORY_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    by_hand = Budget.for_calculator(lj_calc, 500, None)
    by_hand.cost(_argon())
    monkeypatch.setenv(throughput.PROBE_ENV, "off")
    switched_off = Budget.for_calculator(lj_calc, None, None)
    switched_off.cost(_argon())
    assert clock.calls == []
    assert by_hand.profile is None
    assert switched_off.profile is None
    assert by_hand.max_atoms == 500
    assert switched_off.max_atoms is None
    assert switched_off.tuned_max_atoms is None


def test_a_failing_probe_leaves_a_memory_budget(lj_calc, probing, monkeypatch):
    def broken(images, properties=("energy", "forces")):
        raise RuntimeError("model failed")

    monkeypatch.setattr(lj_calc, "calculate_batch", broken)
    budget = Budget.for_calculator(lj_calc, None, None)
    for _ in range(4):
        budget.cost(_argon())  # tried three times, then given up
    assert budget.profile is None
    assert budget.tuned_max_atoms is None
    assert budget.tuned_max_edges is None
    assert budget._probe_with is None
    assert budget._probe_tries == 3


def test_a_damaged_cache_is_probed_again_and_rewritten(lj_calc, probing, monkeypatch):
    clock = FakeClock(MEMORY_BOUND)
    _clocked(lj_calc, clock, monkeypatch)
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    probing.parent.mkdir(parents=True)
    probing.write_text("{not json")
    profile = throughput.cached_profile(lj_calc, _argon())
    assert not profile.cached
    assert clock.calls
    stored = json.loads(probing.read_text())[throughput.profile_key(lj_calc)]
    assert tuple(stored["atoms"]) == profile.atoms
