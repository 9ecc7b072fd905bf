"""Throughput-tuned working batches: the batch size that evaluates fastest.

A memory budget says how large a working batch *may* be; it says nothing about
how fast it runs. On a GPU larger batches are nearly free until the device is
full. On a CPU a message-passing model is bound by memory traffic: SevenNet-0
evaluates a 12-image NEB batch (≈ 37 000 edges) at 0.71 s per image against
0.42 s per image three at a time, so the largest batch that fits is the
slowest per structure.

:func:`probe_throughput` measures it. It evaluates copies of one sample
structure at doubling batch sizes (one model call to warm up, then the
fastest of :data:`REPEATS` timed calls per size), in atoms per second, and
stops once the rate has fallen past its peak (seen twice: the peak and the
slower size are timed again before it counts), the memory budget is reached,
or the probe has spent its time. :class:`ThroughputProfile` is the result;
:meth:`ThroughputProfile.cap_atoms` is the batch size to keep to: the peak,
when a larger batch was measurably slower per atom (by :data:`SLOWDOWN`), and
None while larger batches are as fast or faster (then the memory budget alone
decides, as before).

Profiles are cached per model, device, dtype and thread count in
``throughput.json`` inside :func:`cache_dir` (``$NVALCHEMI_ASE_CACHE``,
default ``~/.cache/nvalchemi_ase``), so a second run on the same machine
skips the probe and batches exactly as the first did.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ase import Atoms

    from nvalchemi_ase.calculator import NVAlchemiCalculator

__all__ = [
    "CACHE_ENV",
    "PROBE_ENV",
    "ThroughputProfile",
    "cache_dir",
    "cached_profile",
    "probe_enabled",
    "probe_throughput",
]

#: Environment variable overriding :func:`cache_dir`.
CACHE_ENV = "NVALCHEMI_ASE_CACHE"
#: Environment variable switching the probe off everywhere (``0``/``off``/``no``).
PROBE_ENV = "NVALCHEMI_ASE_THROUGHPUT_PROBE"
#: Timed model calls per probed size (the fastest counts: load spikes only slow).
REPEATS = 2
#: A size counts as past the peak once its rate is this fraction below the best.
SLOWDOWN = 0.10
#: The probe stops growing the batch once it has spent this long, seconds.
MAX_PROBE_SECONDS = 20.0
#: Largest probed batch, atoms (beyond it the budget alone decides).
MAX_PROBE_ATOMS = 16384

_CACHE_FILE = "throughput.json"
_PROPERTIES = ("energy", "forces")


@dataclass(frozen=True)
class ThroughputProfile:
    """Measured evaluation rate against batch size for one model on one device.

    Attributes
    ----------
    atoms : tuple of int
        Atoms per probed batch, increasing.
    rates : tuple of float
        Atoms evaluated per second at each size (energy and forces).
    seconds : float
        Wall time the probe took, s (0 when read from the cache).
    cached : bool
        Whether the profile was read from the cache instead of measured.
    """

    atoms: tuple[int, ...]
    rates: tuple[float, ...]
    seconds: float = 0.0
    cached: bool = False

    @property
    def best_atoms(self) -> int:
        """Atoms of the fastest probed batch."""
        best = max(range(len(self.rates)), key=self.rates.__getitem__)
        return self.atoms[best]

    @property
    def saturated(self) -> bool:
        """Whether a batch larger than the best was measurably slower per atom."""
        best = max(self.rates)
        peak = self.atoms.index(self.best_atoms)
        return any(rate < (1 - SLOWDOWN) * best for rate in self.rates[peak + 1 :])

    def cap_atoms(self) -> int | None:
        """Atoms a working batch should keep to, or None for no throughput limit."""
        return self.best_atoms if self.saturated else None

    def describe(self) -> str:
        """One line for logs, e.g. ``"peak 96 atoms (1.2e+03 atoms/s); ..."``."""
        sizes = ", ".join(
            f"{n}: {rate:.3g}/s" for n, rate in zip(self.atoms, self.rates, strict=True)
        )
        verdict = (
            f"capped at {self.best_atoms} atoms"
            if self.saturated
            else "no cap (larger batches were not slower)"
        )
        source = "cached" if self.cached else f"probed in {self.seconds:.1f} s"
        return f"throughput {verdict}; atoms/s by batch atoms {sizes} ({source})"


def probe_enabled() -> bool:
    """Whether the throughput probe may run (``$NVALCHEMI_ASE_THROUGHPUT_PROBE``)."""
    value = os.environ.get(PROBE_ENV, "1").strip().lower()
    return value not in {"0", "off", "no", "false"}


def cache_dir() -> Path:
    """Return this package's cache folder.

    Returns
    -------
    pathlib.Path
        ``$NVALCHEMI_ASE_CACHE`` when set, else ``~/.cache/nvalchemi_ase``.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path("~/.cache/nvalchemi_ase").expanduser()


def probe_throughput(
    calc: NVAlchemiCalculator,
    sample: Atoms,
    *,
    max_atoms: float = math.inf,
    max_seconds: float = MAX_PROBE_SECONDS,
    clock: Callable[[], float] | None = None,
) -> ThroughputProfile:
    """Measure ``calc``'s evaluation rate on copies of ``sample`` at doubling sizes.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        The calculator whose model, device and dtype are measured.
    sample : ase.Atoms
        A structure typical of the run (never modified): batches of 1, 2,
        4, ... copies are evaluated (energy and forces).
    max_atoms : float
        Largest batch to try, atoms (the memory budget's share).
    max_seconds : float
        Stop growing the batch once the probe has taken this long, s.
    clock : callable, optional
        Seconds now; default ``time.perf_counter`` (a fake one makes the
        probe testable).

    Returns
    -------
    ThroughputProfile
        Not cached; :func:`cached_profile` caches.
    """
    clock = clock or time.perf_counter
    natoms = max(1, len(sample))
    limit = min(max_atoms, MAX_PROBE_ATOMS)
    started = clock()
    calc.calculate_batch([sample.copy()], _PROPERTIES)  # warm-up: kernels, caches
    sizes: list[int] = []
    rates: list[float] = []
    copies = 1
    while copies * natoms <= max(limit, natoms):
        sizes.append(copies * natoms)
        rates.append(_rate(calc, sample, copies, clock))
        if _past_peak(rates):
            _time_again(calc, sample, sizes, rates, clock)
        if _past_peak(rates) or clock() - started > max_seconds:
            break
        copies *= 2
    return ThroughputProfile(tuple(sizes), tuple(rates), clock() - started)


def _past_peak(rates: list[float]) -> bool:
    """Whether the last size's rate is :data:`SLOWDOWN` below the best so far."""
    return rates[-1] < (1 - SLOWDOWN) * max(rates)


def _time_again(
    calc: NVAlchemiCalculator,
    sample: Atoms,
    sizes: list[int],
    rates: list[float],
    clock: Callable[[], float],
) -> None:
    """Time the best and the last size once more; each keeps its fastest rate.

    A load spike only slows a call, so one unlucky size could otherwise cap
    every later run on this machine (the profile is cached): a slowdown counts
    once it is seen twice.
    """
    natoms = sizes[0]
    for index in (rates.index(max(rates)), len(rates) - 1):
        again = _rate(calc, sample, sizes[index] // natoms, clock)
        rates[index] = max(rates[index], again)


def _rate(
    calc: NVAlchemiCalculator, sample: Atoms, copies: int, clock: Callable[[], float]
) -> float:
    """Atoms per second evaluating ``copies`` copies of ``sample`` (fastest call)."""
    batch = [sample.copy() for _ in range(copies)]
    return copies * max(1, len(sample)) / _fastest_call(calc, batch, clock)


def cached_profile(
    calc: NVAlchemiCalculator, sample: Atoms, *, max_atoms: float = math.inf
) -> ThroughputProfile:
    """Return the cached profile of ``calc``'s model, device and dtype; probe if absent.

    Parameters
    ----------
    calc : NVAlchemiCalculator
        As for :func:`probe_throughput`.
    sample : ase.Atoms
        The structure probed with when nothing is cached.
    max_atoms : float
        As for :func:`probe_throughput`.

    Returns
    -------
    ThroughputProfile
        ``cached=True`` when read back.
    """
    key = profile_key(calc)
    path = cache_dir() / _CACHE_FILE
    stored = _read_cache(path).get(key)
    if stored is not None:
        return ThroughputProfile(
            tuple(int(n) for n in stored["atoms"]),
            tuple(float(r) for r in stored["rates"]),
            cached=True,
        )
    profile = probe_throughput(calc, sample, max_atoms=max_atoms)
    _write_cache_entry(path, key, profile)
    return profile


def profile_key(calc: NVAlchemiCalculator) -> str:
    """Cache key: model class and weights digest, device, dtype, torch threads."""
    import torch

    model = calc.model
    digest = hashlib.sha256(type(model).__qualname__.encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).numpy().tobytes())
    device = torch.device(calc.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return (
        f"{type(model).__name__}:{digest.hexdigest()[:16]}|{where}|"
        f"{calc.dtype}|threads={torch.get_num_threads()}"
    )


def _fastest_call(
    calc: NVAlchemiCalculator, batch: Sequence[Atoms], clock: Callable[[], float]
) -> float:
    """Shortest of :data:`REPEATS` timed evaluations of ``batch``, seconds."""
    best = math.inf
    for _ in range(REPEATS):
        start = clock()
        calc.calculate_batch(batch, _PROPERTIES)
        best = min(best, clock() - start)
    return max(best, 1e-9)


def _read_cache(path: Path) -> dict[str, Any]:
    """Read the cache's entries; an unreadable or damaged cache reads as empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache_entry(path: Path, key: str, profile: ThroughputProfile) -> None:
    """Add one entry, replacing the file atomically (concurrent runs never see half)."""
    entry = asdict(profile)
    entry.pop("cached")
    entries = _read_cache(path)
    entries[key] = {**entry, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(scratch, path)
    except OSError:
        pass  # a read-only home: probe again next time, nothing else lost
