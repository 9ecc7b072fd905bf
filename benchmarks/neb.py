"""Many NEB paths at once: ``relax_paths`` vs ASE's ``NEB`` + ``FIRE`` path after path.

Eight LJ argon paths of seven images (four adatom hops on fcc(100) slabs and
four vacancy hops in bulk cells, 28-49 atoms), from the same linearly
interpolated bands, climbing image, to fmax 0.05 eV/Å: one
``nvalchemi_ase.mep.relax_paths`` call (every image of every path in one
model call per step) against ``ase.mep.NEB`` + ``ase.optimize.FIRE`` with
``NVAlchemiCalculator``, one path after another (one model call per interior
image per step). Both sides are timed in alternation; medians are reported,
with the steps each side took. Run alone with
``python -m benchmarks --only neb``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.harness import Report, Settings

ARGON_A = 5.26  # Å
FMAX = 0.05  # eV/Å
SLABS = ((3, 3, 3), (4, 3, 3), (4, 4, 3), (3, 3, 4))
CELLS = ((2, 2, 2), (2, 2, 3), (3, 2, 2), (2, 3, 2))


def vacancy_hop(repeat: tuple[int, int, int]) -> tuple[Any, Any]:
    from ase.build import bulk

    crystal = bulk("Ar", "fcc", a=ARGON_A, cubic=True).repeat(repeat)
    initial, final = crystal.copy(), crystal.copy()
    final.positions[1] = crystal.positions[0]
    del initial[0]
    del final[0]
    return initial, final


def adatom_hop(size: tuple[int, int, int]) -> tuple[Any, Any]:
    from ase.build import add_adsorbate, fcc100
    from ase.constraints import FixAtoms

    slab = fcc100("Ar", size=size, a=ARGON_A, vacuum=7.0)
    slab.set_constraint(FixAtoms(mask=slab.get_tags() == size[2]))
    initial, final = slab.copy(), slab.copy()
    add_adsorbate(initial, "Ar", ARGON_A / 2, "hollow")
    add_adsorbate(final, "Ar", ARGON_A / 2, "hollow", offset=(1, 0))
    return initial, final


def make_bands(count: int, n_images: int, calc: Any) -> list[list[Any]]:
    """``count`` linearly interpolated LJ bands with relaxed endpoints."""
    builders = [lambda s=s: adatom_hop(s) for s in SLABS] + [
        lambda c=c: vacancy_hop(c) for c in CELLS
    ]
    pairs = [builders[k % len(builders)]() for k in range(count)]
    return bands_between(pairs, n_images, calc, endpoint_fmax=0.002)


def bands_between(
    pairs: list[tuple[Any, Any]], n_images: int, calc: Any, *, endpoint_fmax: float
) -> list[list[Any]]:
    """Relax every endpoint (one batched FIRE), then interpolate each band."""
    from ase.mep import interpolate

    from nvalchemi_ase.optimize import FIRE

    endpoints = [atoms for pair in pairs for atoms in pair]
    for atoms in endpoints:
        atoms.calc = calc
    FIRE(endpoints, logfile=None).run(fmax=endpoint_fmax, steps=2000)
    bands = []
    for initial, final in pairs:
        band = [initial.copy() for _ in range(n_images - 1)] + [final.copy()]
        interpolate(band, mic=True)
        bands.append(band)
    return bands


def ase_neb(
    band: list[Any], calc: Any, *, fmax: float, steps: int
) -> tuple[int, float]:
    """ASE's ``NEB`` + ``FIRE`` on one band: (steps, highest image - first, eV)."""
    from ase.mep import NEB
    from ase.optimize import FIRE

    images = [atoms.copy() for atoms in band]
    for atoms in images:
        atoms.calc = calc
    neb = NEB(
        images, climb=True, method="improvedtangent", allow_shared_calculator=True
    )
    opt = FIRE(neb, logfile=None)
    opt.run(fmax=fmax, steps=steps)
    energies = [atoms.get_potential_energy() for atoms in images]
    return opt.nsteps, max(energies) - energies[0]


def neb_paths(settings: Settings, report: Report) -> None:

    from benchmarks.harness import interleaved_medians
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.mep import relax_paths

    count, n_images = (2, 5) if settings.quick else (8, 7)
    steps = 10 if settings.quick else 1000
    calc = NVAlchemiCalculator("lj", device=settings.device, dtype="float64")
    bands = make_bands(count, n_images, calc)
    taken: dict[str, list[int]] = {}

    def batched() -> None:
        results = relax_paths(
            bands, calc, fmax=FMAX, steps=steps, climb=True, interpolate=None
        )
        taken["batched"] = [result.steps for result in results]

    def sequential() -> None:
        taken["sequential"] = [
            ase_neb(band, calc, fmax=FMAX, steps=steps)[0] for band in bands
        ]

    t_batched, t_sequential = interleaved_medians(
        [batched, sequential], settings.repeats
    )
    atoms = sorted({len(band[0]) for band in bands})
    report.table(
        "6. NEB: many paths in one batch vs ASE path after path (LJ argon, float64)",
        [
            "paths × images",
            "atoms/image",
            "ASE NEB + FIRE, sequential s",
            "relax_paths s",
            "steps (ASE / batched)",
            "speed-up",
        ],
        [
            [
                f"{count} × {n_images}",
                f"{atoms[0]}-{atoms[-1]}",
                f"{t_sequential:.2f}",
                f"{t_batched:.2f}",
                f"{sum(taken['sequential'])} / {max(taken['batched'])}",
                f"{t_sequential / t_batched:.1f}×",
            ]
        ],
        "Same bands (linear interpolation, relaxed endpoints), climbing image, "
        f"fmax {FMAX} eV/Å. ASE: `ase.mep.NEB` + `ase.optimize.FIRE` with "
        "`NVAlchemiCalculator`, one path after another (one model call per "
        "interior image per step); batched: `nvalchemi_ase.mep.relax_paths` (one "
        "model call per step for every image of every path; nvalchemi's NEB "
        "engine with its FIRE2, given ASE's FIRE defaults). Steps: ASE's summed "
        "over paths, the batch's longest path. Target ≥ 10×.",
    )


COPPER_A = 3.61  # Å


def copper_vacancy_hop(repeat: tuple[int, int, int]) -> tuple[Any, Any]:
    """A nearest-neighbour vacancy hop in an fcc copper supercell."""
    from ase.build import bulk

    crystal = bulk("Cu", "fcc", a=COPPER_A, cubic=True).repeat(repeat)
    initial, final = crystal.copy(), crystal.copy()
    final.positions[1] = crystal.positions[0]
    del initial[0]
    del final[0]
    return initial, final


def neb_sevennet(settings: Settings, report: Report) -> None:
    """The NEB comparison on SevenNet-0: vacancy hops in small copper cells."""

    from benchmarks.harness import interleaved_medians
    from nvalchemi_ase import NVAlchemiCalculator
    from nvalchemi_ase.mep import relax_paths

    repeats = ((2, 2, 2), (3, 2, 2), (2, 3, 2), (2, 2, 3))
    count, n_images = (1, 3) if settings.quick else (4, 5)
    steps, fmax = (3, 0.1) if settings.quick else (300, 0.1)
    calc = NVAlchemiCalculator("sevennet-0", device=settings.device)
    pairs = [copper_vacancy_hop(repeats[k]) for k in range(count)]
    bands = bands_between(pairs, n_images, calc, endpoint_fmax=0.01)
    taken: dict[str, list[int]] = {}
    barriers: dict[str, list[float]] = {}

    def batched() -> None:
        results = relax_paths(
            bands, calc, fmax=fmax, steps=steps, climb=True, interpolate=None
        )
        taken["batched"] = [result.steps for result in results]
        barriers["batched"] = [result.barrier_forward for result in results]

    def sequential() -> None:
        runs = [ase_neb(band, calc, fmax=fmax, steps=steps) for band in bands]
        taken["sequential"] = [steps_taken for steps_taken, _ in runs]
        barriers["sequential"] = [barrier for _, barrier in runs]

    t_batched, t_sequential = interleaved_medians([batched, sequential], 1, warmup=0)
    atoms = sorted({len(band[0]) for band in bands})
    report.table(
        "6b. NEB on SevenNet-0: vacancy hops in copper (float32)",
        [
            "paths × images",
            "atoms/image",
            "ASE NEB + FIRE, sequential s",
            "relax_paths s",
            "steps (ASE / batched)",
            "barriers eV (ASE / batched)",
            "speed-up",
        ],
        [
            [
                f"{count} × {n_images}",
                f"{atoms[0]}-{atoms[-1]}",
                f"{t_sequential:.1f}",
                f"{t_batched:.1f}",
                f"{sum(taken['sequential'])} / {max(taken['batched'])}",
                " ".join(f"{b:.3f}" for b in barriers["sequential"])
                + " / "
                + " ".join(f"{b:.3f}" for b in barriers["batched"]),
                f"{t_sequential / t_batched:.1f}×",
            ]
        ],
        "As section 6, on SevenNet-0 (float32, CPU) with nearest-neighbour "
        f"vacancy hops in 31-47-atom copper cells, fmax {fmax} eV/Å, one timed "
        "round each (SevenNet-0 is slow on a CPU).",
    )
