"""Every model family, batched, against the model's own ASE calculator.

``python -m benchmarks --only models``. For each family available offline:

* MACE: a random-weight ``ScaleShiftMACE`` built with mace-torch's constructors
  (:mod:`tests.mace_models`), saved and read both by ``load_model("mace",
  path=...)`` and by ``mace.calculators.MACECalculator``;
* SevenNet-0 (the checkpoint in the ``sevenn`` wheel) vs ``SevenNetCalculator``;
* AIMNet2: a random-weight model written by aimnet's own exporter
  (:mod:`tests.aimnet2_models`) vs aimnet's ``AIMNet2ASE`` (Coulomb and D3 off on
  both sides, as nvalchemi's wrapper is the short-range part);
* DFT-D3(BJ), PBE parameters, vs s-dftd3's ``dftd3.ase.DFTD3`` (``s9 = 0`` and
  the same real-space cutoffs, as nvalchemi's kernel has no three-body term);
* the composition ``sevennet-0+d3`` vs ASE's ``SumCalculator`` of the two.

Two timings per family on 32 mixed structures (molecules, slabs, bulk; 2-64
atoms): single points (energy + forces) with ``calculate_batch`` vs the
model's calculator structure after structure, and 20 steps of FIRE (our
batched ``FIRE`` vs ASE's ``FIRE`` on one structure after another). Same
weights, one process, sides timed in alternation after a warm-up; medians and
ratios. Every side is checked to give the same numbers before it is timed.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Report, Settings, interleaved_samples, load_average

STRUCTURES = 32
FIRE_STEPS = 20


@dataclass
class Family:
    """One model family: our model, its own ASE calculator, its structures."""

    label: str
    size: str  # parameters, cutoff, dtype
    ours: Any  # NVAlchemiCalculator
    theirs: Callable[[], Any]  # a fresh calculator of the model's own package
    structures: list[Any]
    dtype: str


# ---------------------------------------------------------------------------
# structures
# ---------------------------------------------------------------------------


def mixed_structures(count: int, elements: str = "HCNOAlSiCu") -> list[Any]:
    """``count`` rattled molecules, slabs and crystals of 2-64 atoms, cycled."""
    from ase.build import bulk, fcc100, fcc111, molecule

    builders: list[Callable[[], Any]] = [
        lambda: molecule("CH4"),
        lambda: bulk("Si", "diamond", 5.43, cubic=True),
        lambda: fcc111("Cu", (2, 2, 3), vacuum=6.0),
        lambda: molecule("C6H6"),
        lambda: bulk("Cu", "fcc", 3.61, cubic=True).repeat((2, 2, 2)),
        lambda: molecule("CH3CH2OH"),
        lambda: fcc100("Al", (2, 2, 4), vacuum=6.0),
        lambda: bulk("Si", "diamond", 5.43, cubic=True).repeat((2, 2, 1)),
        lambda: molecule("H2O"),
        lambda: bulk("Al", "fcc", 4.05, cubic=True).repeat((2, 2, 1)),
        lambda: molecule("CH3CONH2"),
        lambda: fcc111("Al", (3, 3, 3), vacuum=6.0),
        lambda: molecule("N2"),
        lambda: bulk("Cu", "fcc", 3.61),
        lambda: bulk("Si", "diamond", 5.43, cubic=True).repeat((2, 2, 2)),
        lambda: molecule("HCOOH"),
    ]
    structures = []
    for index in range(count):
        atoms = builders[index % len(builders)]()
        assert set(atoms.get_chemical_symbols()) <= set(_symbols(elements))
        atoms.rattle(0.05, seed=index)
        structures.append(atoms)
    return structures


def _symbols(elements: str) -> list[str]:
    from ase.symbols import string2symbols

    return string2symbols(elements)


def molecules_for_aimnet2(count: int) -> list[Any]:
    """``count`` rattled H/C/N/O/S/Cl molecules (3-26 atoms), some charged."""
    from ase.build import molecule

    names = [
        ("CH4", 0),
        ("C6H6", 0),
        ("CH3CH2OH", 0),
        ("H2O", -1),
        ("CH3CONH2", 0),
        ("CH3SH", 0),
        ("C6H6", 1),
        ("CH3Cl", 0),
        ("HCOOH", 0),
        ("NH3", 1),
        ("bicyclobutane", 0),
        ("trans-butane", 0),
        ("CH3COCH3", 0),
        ("C4H4NH", 0),
        ("CH3CH2Cl", 0),
        ("H2CCO", 0),
    ]
    structures = []
    for index in range(count):
        name, charge = names[index % len(names)]
        atoms = molecule(name)
        atoms.rattle(0.05, seed=index)
        atoms.info["charge"] = charge
        structures.append(atoms)
    return structures


# ---------------------------------------------------------------------------
# families
# ---------------------------------------------------------------------------


def _parameters(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _mace(folder: Path, count: int) -> Family:
    import torch
    from mace.calculators import MACECalculator

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models import load_model
    from tests.mace_models import TEST_CUTOFF, save_random_mace

    path = save_random_mace(folder / "mace.model", channels=16, max_ell=2)
    model = load_model("mace", path=path)
    size = (
        f"random ScaleShiftMACE, 16x0e+16x1o, L_max 2, correlation 2, 2 layers, "
        f"{_parameters(model):,} parameters, cutoff {TEST_CUTOFF} Å, float64"
    )

    def theirs() -> Any:
        dtype = torch.get_default_dtype()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calc = MACECalculator(
                model_paths=str(path), device="cpu", default_dtype="float64"
            )
        torch.set_default_dtype(dtype)  # MACECalculator sets it globally ...
        calculate = calc.calculate

        def in_float64(*args: Any, **kwargs: Any) -> Any:
            # ... and builds its inputs in it: float64 while it calculates only
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                return calculate(*args, **kwargs)
            finally:
                torch.set_default_dtype(previous)

        calc.calculate = in_float64
        return calc

    return Family(
        "MACE",
        size,
        NVAlchemiCalculator(model, device="cpu", dtype="float64"),
        theirs,
        mixed_structures(count),
        "float64",
    )


def _sevennet(count: int) -> Family:
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models import load_model

    model = load_model("sevennet-0")

    def theirs() -> Any:
        from sevenn.calculator import SevenNetCalculator

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SevenNetCalculator("7net-0", device="cpu")

    return Family(
        "SevenNet-0",
        f"SevenNet-0 (11Jul2024), {_parameters(model):,} parameters, cutoff 5 Å, "
        "float32",
        NVAlchemiCalculator(model, device="cpu"),
        theirs,
        mixed_structures(count),
        "float32",
    )


def _aimnet2(folder: Path, count: int) -> Family:
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models import load_model
    from tests.aimnet2_models import save_random_aimnet2

    path = save_random_aimnet2(folder)
    model = load_model("aimnet2", path=path)

    def theirs() -> Any:
        from aimnet.calculators import AIMNet2ASE, AIMNet2Calculator

        base = AIMNet2Calculator(
            str(path), needs_coulomb=False, needs_dispersion=False, device="cpu"
        )
        base.set_lr_cutoff(5.0)  # as tests/test_aimnet2.py: the same pairs
        return AIMNet2ASE(base)  # reads the charge from atoms.info

    return Family(
        "AIMNet2",
        f"random AIMNet2 (aimnet's YAML, layers 32/24, AIM size 16), "
        f"{_parameters(model):,} parameters, cutoff 5 Å, float32",
        NVAlchemiCalculator(model, device="cpu"),
        theirs,
        molecules_for_aimnet2(count),
        "float32",
    )


D3_CUTOFF = 12.0  # Å, pairs and coordination numbers, both sides


def _d3_reference() -> Any:
    from dftd3.ase import DFTD3

    from nvalchemi_ase.models.dispersion import d3_parameters

    return DFTD3(
        damping="d3bj",
        params_tweaks={**d3_parameters("pbe", "bj"), "s9": 0.0},
        realspace_cutoff={"disp2": D3_CUTOFF, "cn": D3_CUTOFF},
    )


def _d3(count: int) -> Family:
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models import load_model

    model = load_model("d3", functional="pbe", cutoff=D3_CUTOFF, smoothing_fraction=0)
    return Family(
        "D3(BJ)",
        f"PBE parameters, two-body, cutoff {D3_CUTOFF} Å (pairs and CN), float64 "
        "batch (nvalchemiops' float32 kernel)",
        NVAlchemiCalculator(model, device="cpu", dtype="float64"),
        _d3_reference,
        mixed_structures(count),
        "float64",
    )


def _composed(count: int) -> Family:
    from ase.calculators.mixing import SumCalculator

    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.models import load_model

    model = load_model(f"sevennet-0+d3(pbe, cutoff={D3_CUTOFF}, smoothing_fraction=0)")

    def theirs() -> Any:
        from sevenn.calculator import SevenNetCalculator

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seven = SevenNetCalculator("7net-0", device="cpu")
        return SumCalculator([seven, _d3_reference()])

    return Family(
        "SevenNet-0 + D3(BJ)",
        "the two above summed (nvalchemi's `PipelineModelWrapper` vs ASE's "
        "`SumCalculator`)",
        NVAlchemiCalculator(model, device="cpu"),
        theirs,
        mixed_structures(count),
        "float32",
    )


def families(folder: Path, count: int) -> tuple[list[Family], list[str]]:
    """Every family whose package is installed, and a line for each skipped one."""
    wanted: list[tuple[str, str, Callable[[], Family]]] = [
        ("MACE", "mace", lambda: _mace(folder, count)),
        ("SevenNet-0", "sevenn", lambda: _sevennet(count)),
        ("AIMNet2", "aimnet", lambda: _aimnet2(folder, count)),
        ("D3(BJ)", "dftd3", lambda: _d3(count)),
        ("SevenNet-0 + D3(BJ)", "dftd3", lambda: _composed(count)),
    ]
    found, skipped = [], []
    for label, package, build in wanted:
        missing = [
            name
            for name in (package, "tad_dftd3" if "D3" in label else package)
            if importlib.util.find_spec(name) is None
        ]
        if missing:
            skipped.append(f"{label}: `{missing[0]}` not installed")
        else:
            found.append(build())
    return found, skipped


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def _single_points(family: Family) -> tuple[Callable[[], Any], Callable[[], Any]]:
    theirs = family.theirs()

    def ours() -> list[Any]:
        results = family.ours.calculate_batch(family.structures, ["energy", "forces"])
        return [(r["energy"], r["forces"]) for r in results]

    def sequential() -> list[Any]:
        out = []
        for atoms in family.structures:
            atoms = atoms.copy()
            atoms.calc = theirs
            out.append((atoms.get_potential_energy(), atoms.get_forces()))
        return out

    return ours, sequential


def _fire(family: Family, steps: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    from ase.optimize import fire as ase_fire

    from nvalchemi_ase.optimize import FIRE

    theirs = family.theirs()

    def ours() -> np.ndarray:
        images = [atoms.copy() for atoms in family.structures]
        for atoms in images:
            atoms.calc = family.ours
        FIRE(images, logfile=None).run(fmax=1e-9, steps=steps)
        return np.concatenate([atoms.positions for atoms in images])

    def sequential() -> np.ndarray:
        images = []
        for atoms in family.structures:
            atoms = atoms.copy()
            atoms.calc = theirs
            ase_fire.FIRE(atoms, logfile=None).run(fmax=1e-9, steps=steps)
            images.append(atoms.positions)
        return np.concatenate(images)

    return ours, sequential


def _agreement(ours: list[Any], theirs: list[Any]) -> str:
    pairs = list(zip(ours, theirs, strict=True))
    de = max(abs(a[0] - b[0]) for a, b in pairs)
    df = max(float(np.abs(a[1] - b[1]).max()) for a, b in pairs)
    return f"ΔE ≤ {de:.0e} eV, ΔF ≤ {df:.0e} eV/Å"


def _forward_share(family: Family) -> str:
    """Share of a batched single point spent in the model's forward + backward.

    The rest is the neighbour list, the batch and the results; a share near 1
    means batching can only win what it saves inside the model itself.
    """
    import torch

    from nvalchemi_ase import atoms_to_batch
    from nvalchemi_ase.models.composition import build_neighbors

    calc = family.ours
    batch = atoms_to_batch(
        family.structures, device="cpu", dtype=getattr(torch, family.dtype)
    )
    build_neighbors(calc.model, batch)

    def forward() -> None:
        calc.model(batch)

    def whole() -> None:
        calc.calculate_batch(family.structures, ["energy", "forces"])

    samples = interleaved_samples([forward, whole], 2)
    share = statistics.median(samples[0].wall) / statistics.median(samples[1].wall)
    return f"{100 * share:.0f} %"


def run(settings: Settings, report: Report) -> None:
    """The models section: single points and FIRE, batched vs their calculators."""
    import torch

    # FIRE: one timed round after the checked (warm-up) one; a full run is
    # about an hour on a 2-core CPU under a load of 10-14, mostly SevenNet-0
    count = 4 if settings.quick else STRUCTURES
    steps = 2 if settings.quick else FIRE_STEPS
    rounds = 1 if settings.quick else 3
    fire_rounds = 1
    rows, notes = [], []
    load_before = load_average()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        found, skipped = families(Path(folder), count)
        for family in found:
            print(f"models: {family.label}", flush=True)
            ours, sequential = _single_points(family)
            agreement = _agreement(ours(), sequential())  # also a warm-up
            sp = interleaved_samples([ours, sequential], rounds, warmup=0)
            fire_ours, fire_theirs = _fire(family, steps)
            moved = float(np.abs(fire_ours() - fire_theirs()).max())  # warm-up too
            fire = interleaved_samples([fire_ours, fire_theirs], fire_rounds, 0)
            share = "n/a" if settings.quick else _forward_share(family)
            atoms_total = sum(len(a) for a in family.structures)
            t_sp = [statistics.median(s.wall) for s in sp]
            t_fire = [statistics.median(s.wall) for s in fire]
            rows.append(
                [
                    family.label,
                    f"{len(family.structures)} ({atoms_total} atoms)",
                    f"{1e3 * t_sp[1] / count:.1f}",
                    f"{1e3 * t_sp[0] / count:.1f}",
                    f"{t_sp[1] / t_sp[0]:.2f}×",
                    f"{t_fire[1]:.2f}",
                    f"{t_fire[0]:.2f}",
                    f"{t_fire[1] / t_fire[0]:.2f}×",
                    share,
                    f"{agreement}; FIRE positions Δ ≤ {moved:.0e} Å",
                ]
            )
            notes.append(f"**{family.label}**: {family.size}")
    notes.extend(f"skipped: {line}" for line in skipped)
    report.table(
        f"12. Models: batched vs each model's own ASE calculator ({count} mixed "
        f"structures, single points and {steps} FIRE steps)",
        [
            "model",
            "structures",
            "own calculator ms/structure",
            "batched ms/structure",
            "single-point speed-up",
            f"ASE FIRE × {count} s",
            "batched FIRE s",
            "FIRE speed-up",
            "forward share of a batched call",
            "agreement",
        ],
        rows,
        "Structures: molecules, fcc(111)/(100) slabs and bulk crystals of 2-64 "
        "atoms, rattled (AIMNet2: 16 organic molecules, some charged, cycled). "
        "Own calculator: the model package's ASE calculator on one structure after "
        "another (single points; ASE's `FIRE` for the FIRE column). Batched: "
        "`NVAlchemiCalculator.calculate_batch` and `nvalchemi_ase.optimize.FIRE` "
        "on the whole list. Same weights on both sides; the sides are timed in "
        f"alternation ({rounds} rounds of single points, {fire_rounds} of FIRE, "
        "after a warm-up round that also checks agreement), medians of wall time. "
        "*Forward share* is the time of the model's forward + backward on a "
        "ready batch (neighbour list built) over a whole batched single point. "
        f"torch threads {torch.get_num_threads()}; load average (1, 5, 15 min) "
        f"{load_before} before, {load_average()} after; section time "
        f"{time.perf_counter() - start:.0f} s. " + "; ".join(notes) + ".",
    )
