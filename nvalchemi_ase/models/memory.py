"""How much memory a model needs for a batch, and how much there is.

A batch's peak memory is modelled as linear in its atoms and its edges (pairs
of atoms closer than the model's cutoff, both directions counted, periodic
images included)::

    bytes = bytes_per_atom * atoms + bytes_per_edge * edges

:func:`memory_estimate` gives the two coefficients of a model for a dtype and
device (:class:`MemoryEstimate`), :func:`count_edges` counts the edges of a
structure cheaply, and :func:`available_memory` says how much memory is free
where the model runs (host RAM on the CPU, device memory on a GPU). The command
line sizes its batches from them (:data:`SAFETY_FRACTION` of what is free).

Where the numbers come from, in order:

1. the model's own declaration: an attribute :data:`MEMORY_ATTRIBUTE`
   (``model.memory_estimate``) holding a :class:`MemoryEstimate`, or a callable
   ``(dtype, device) -> MemoryEstimate``;
2. measurements of the models :func:`~nvalchemi_ase.models.load_model` builds
   (table below);
3. :data:`DEFAULT_ESTIMATE` for any other model (conservative: about twice
   SevenNet-0's need per edge).

Measured (CPU, torch 2.14, nvalchemi 0.3, 2 cores): the peak resident-set
growth of a fresh process over one workload, after a warm-up on a one-cell
structure (same code path), ``malloc_trim(0)`` and a reset of the kernel's
high-water mark (``/proc/self/clear_refs``), read from ``VmHWM``. Workloads: a
single point with energy, forces and stress (``calculate_batch``), 3 FIRE steps
and 3 Langevin steps (the dynamics build their neighbour list with a 1 Å skin);
the largest of the three counts. Edges: a full neighbour list at the model's
cutoff (``ase.neighborlist``).

==========  =======  ===================================  ====================
model       dtype    structures (atoms)                   estimate
==========  =======  ===================================  ====================
SevenNet-0  float32  Si diamond (64, 216), Cu fcc         80 kB/atom +
                     (108, 256); 28 and 42 edges/atom     240 kB/edge
LJ 8.5 Å    float64  Ar fcc a = 5.26 and 4.60 Å           40 B per neighbour-
                     (864, 4000)                          matrix slot per atom
==========  =======  ===================================  ====================

SevenNet-0: 430 MB (64 Si) to 2.44 GB (256 Cu); least squares over the four
structures give 227 kB per edge and about 20 kB per atom (poorly determined:
atoms and edges grow together), plus about 20 MB per batch; the estimate is
1-7 % above every measurement. LJ keeps its neighbours in a dense matrix whose
width nvalchemi sizes from the cutoff alone (0.2 atoms/Å³ inside
``cutoff + skin``: 720 slots at 8.5 + 1 Å), so its need is per atom, whatever
the density: 8.8-9.2 kB (single point) to 12.6-27.2 kB (dynamics) per atom;
40 B per slot gives 28.8 kB. Numbers measured in one dtype are scaled up, never
down, for a wider one (float32 → float64 doubles them). On a GPU the CPU
numbers are used (not measured there): the same tensors are allocated, and
torch's caching allocator reuses memory rather than keeping transient copies.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nvalchemi_ase.models.composition import composed_parts

if TYPE_CHECKING:
    from ase import Atoms

__all__ = [
    "DEFAULT_ESTIMATE",
    "MAX_COUNTED_IMAGES",
    "MEMORY_ATTRIBUTE",
    "SAFETY_FRACTION",
    "MemoryEstimate",
    "available_memory",
    "count_edges",
    "dense_matrix_estimate",
    "format_bytes",
    "memory_estimate",
]

#: Attribute a model may carry to declare its own :class:`MemoryEstimate` (or a
#: callable ``(dtype, device) -> MemoryEstimate``).
MEMORY_ATTRIBUTE = "memory_estimate"
#: Fraction of the free memory a batch may be estimated to need.
SAFETY_FRACTION = 0.5
#: Verlet skin the dynamics add to the model's cutoff, Å (as ``DEFAULT_SKIN``).
_DYNAMICS_SKIN = 1.0
#: Bytes per slot of nvalchemi's dense neighbour matrix (LJ, measured, see above).
_LJ_BYTES_PER_SLOT = 40.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one model evaluation (forward and backward), per atom and edge.

    Attributes
    ----------
    bytes_per_atom : float
        Bytes per atom of the batch.
    bytes_per_edge : float
        Bytes per edge: an ordered pair of atoms (periodic images included)
        closer than ``cutoff``.
    edges_per_atom_hint : float
        Typical edges per atom at ``cutoff`` in a dense solid, for sizing
        without counting (e.g. turning a memory budget into a number of atoms).
    cutoff : float or None
        Radius, Å, within which edges are counted; None: the model uses no
        neighbour list (edges cost nothing).
    basis : str
        Where the numbers come from ("measured ...", "declared by the model",
        "default for unknown models").
    """

    bytes_per_atom: float
    bytes_per_edge: float
    edges_per_atom_hint: float = 50.0
    cutoff: float | None = None
    basis: str = "declared by the model"

    def __post_init__(self) -> None:
        for name in ("bytes_per_atom", "bytes_per_edge", "edges_per_atom_hint"):
            value = getattr(self, name)
            if (
                not (isinstance(value, int | float) and math.isfinite(value))
                or value < 0
            ):
                raise ValueError(f"MemoryEstimate.{name} must be >= 0, got {value!r}")

    def bytes_for(self, atoms: int, edges: float) -> float:
        """Estimated peak bytes of a batch.

        Parameters
        ----------
        atoms : int
            Atoms in the batch.
        edges : float
            Edges in the batch (see :func:`count_edges`).

        Returns
        -------
        float
            Bytes.
        """
        return self.bytes_per_atom * atoms + self.bytes_per_edge * edges

    def atoms_within(self, budget: float) -> int:
        """Atoms that fit in ``budget`` bytes at :attr:`edges_per_atom_hint`.

        Parameters
        ----------
        budget : float
            Bytes.

        Returns
        -------
        int
            At least 1.
        """
        edges = self.edges_per_atom_hint if self.cutoff is not None else 0.0
        per_atom = self.bytes_per_atom + self.bytes_per_edge * edges
        return max(1, int(budget // per_atom)) if per_atom > 0 else 1 << 62


#: For models with neither a declaration nor a measurement: 64 kB per atom and
#: 512 kB per edge in float32 (twice that in float64), edges at the model's cutoff.
DEFAULT_ESTIMATE = MemoryEstimate(
    bytes_per_atom=64e3,
    bytes_per_edge=512e3,
    edges_per_atom_hint=60.0,
    cutoff=None,
    basis="default for unknown models (declare model.memory_estimate to refine)",
)


def memory_estimate(
    model: Any, dtype: torch.dtype, device: torch.device | str
) -> MemoryEstimate:
    """Return the memory estimate of ``model`` run in ``dtype`` on ``device``.

    Parameters
    ----------
    model : BaseModelMixin
        An nvalchemi model (from :func:`~nvalchemi_ase.models.load_model` or any
        other).
    dtype : torch.dtype
        Precision it runs in.
    device : torch.device or str
        Where it runs (measurements are from the CPU and used everywhere).

    Returns
    -------
    MemoryEstimate
        Per-atom and per-edge bytes; ``cutoff`` is the model's neighbour-list
        cutoff (Å) unless the declaration sets another.

    Raises
    ------
    TypeError
        If ``model.memory_estimate`` is neither a ``MemoryEstimate`` nor a callable
        returning one.
    """
    cutoff = _model_cutoff(model)
    declared = getattr(model, MEMORY_ATTRIBUTE, None)
    if declared is not None:
        estimate = (
            declared(dtype, torch.device(device)) if callable(declared) else declared
        )
        if not isinstance(estimate, MemoryEstimate):
            raise TypeError(
                f"{type(model).__name__}.{MEMORY_ATTRIBUTE} must be a "
                f"nvalchemi_ase.models.memory.MemoryEstimate (or a callable "
                f"returning one), got {type(estimate).__name__}"
            )
        return (
            estimate
            if estimate.cutoff is not None
            else replace(estimate, cutoff=cutoff)
        )
    parts = composed_parts(model)
    if len(parts) > 1:
        return _sum_of_parts(
            [memory_estimate(part, dtype, device) for part in parts], cutoff
        )
    measured = _MEASURED.get(type(model).__name__)
    if measured is not None:
        return measured(model, dtype, cutoff)
    scale = _dtype_scale(dtype, torch.float32)
    return replace(
        DEFAULT_ESTIMATE,
        bytes_per_atom=DEFAULT_ESTIMATE.bytes_per_atom * scale,
        bytes_per_edge=DEFAULT_ESTIMATE.bytes_per_edge * scale,
        cutoff=cutoff,
    )


def _sevennet(model: Any, dtype: torch.dtype, cutoff: float | None) -> MemoryEstimate:
    scale = _dtype_scale(dtype, torch.float32)
    return MemoryEstimate(
        bytes_per_atom=80e3 * scale,
        bytes_per_edge=240e3 * scale,
        edges_per_atom_hint=45.0,
        cutoff=cutoff,
        basis="measured (SevenNet-0, float32, CPU)",
    )


def _lennard_jones(
    model: Any, dtype: torch.dtype, cutoff: float | None
) -> MemoryEstimate:
    slots = _matrix_slots((cutoff or 0.0) + _DYNAMICS_SKIN)
    scale = _dtype_scale(dtype, torch.float64)
    return MemoryEstimate(
        bytes_per_atom=_LJ_BYTES_PER_SLOT * slots * scale,
        bytes_per_edge=0.0,
        edges_per_atom_hint=80.0,
        cutoff=cutoff,
        basis="measured (LJ, float64, CPU)",
    )


def dense_matrix_estimate(cutoff: float, name: str) -> MemoryEstimate:
    """Estimate for a model that keeps nvalchemi's dense neighbour matrix (D3).

    As for LJ: :data:`_LJ_BYTES_PER_SLOT` per slot of the matrix nvalchemi
    sizes from ``cutoff`` + the dynamics' skin alone (not measured for
    ``name``; the matrix and its shifts dominate).

    Parameters
    ----------
    cutoff : float
        The model's cutoff, Å.
    name : str
        The model, for :attr:`MemoryEstimate.basis`.

    Returns
    -------
    MemoryEstimate
        Per-atom bytes only.
    """
    return MemoryEstimate(
        bytes_per_atom=_LJ_BYTES_PER_SLOT * _matrix_slots(cutoff + _DYNAMICS_SKIN),
        bytes_per_edge=0.0,
        edges_per_atom_hint=80.0,
        cutoff=cutoff,
        basis=f"{name}: neighbour-matrix width at its cutoff (as LJ, not measured)",
    )


def _sum_of_parts(
    estimates: list[MemoryEstimate], cutoff: float | None
) -> MemoryEstimate:
    """Add a composed model's parts' estimates.

    Edges are counted at the largest cutoff of the parts that pay per edge
    (one such part in practice: an MLIP beside D3 or LJ), which over-counts
    the others' edges: the estimate errs on the safe side.
    """
    per_edge = [e for e in estimates if e.bytes_per_edge > 0]
    edge_cutoffs = [e.cutoff for e in per_edge if e.cutoff is not None]
    return MemoryEstimate(
        bytes_per_atom=sum(e.bytes_per_atom for e in estimates),
        bytes_per_edge=sum(e.bytes_per_edge for e in per_edge),
        edges_per_atom_hint=max(
            (e.edges_per_atom_hint for e in per_edge), default=50.0
        ),
        cutoff=max(edge_cutoffs) if edge_cutoffs else cutoff,
        basis="sum of its parts: " + "; ".join(e.basis for e in estimates),
    )


_MEASURED: dict[str, Callable[[Any, torch.dtype, float | None], MemoryEstimate]] = {
    "SevenNetWrapper": _sevennet,
    "LennardJonesModelWrapper": _lennard_jones,
}


def _matrix_slots(cutoff: float) -> int:
    """Width of nvalchemi's dense neighbour matrix for ``cutoff`` (Å).

    nvalchemi's ``estimate_max_neighbors``: 0.2 atoms/Å³ in the cutoff sphere,
    at least 16, rounded up to a multiple of 16.
    """
    expected = max(16.0, 0.2 * 4.0 / 3.0 * math.pi * cutoff**3)
    return math.ceil(expected / 16.0) * 16


def _dtype_scale(dtype: torch.dtype, measured: torch.dtype) -> float:
    """Factor for running in ``dtype`` what was measured in ``measured`` (>= 1)."""
    wanted = torch.empty((), dtype=dtype).element_size()
    base = torch.empty((), dtype=measured).element_size()
    return max(1.0, wanted / base)


def _model_cutoff(model: Any) -> float | None:
    config = getattr(getattr(model, "model_config", None), "neighbor_config", None)
    cutoff = getattr(config, "cutoff", None)
    return None if cutoff is None else float(cutoff)


# -- edges ----------------------------------------------------------------------


#: Periodic images per side beyond which :func:`count_edges` does not count:
#: the structure is one :func:`~nvalchemi_ase.convert.check_images` refuses
#: (its :data:`~nvalchemi_ase.convert.MAX_PERIODIC_IMAGES`), so it gets inf.
MAX_COUNTED_IMAGES = 16
#: Floats of the (images x atoms x 3) distance blocks :func:`count_edges` makes.
_BLOCK_FLOATS = 4_000_000


def count_edges(atoms: Atoms, cutoff: float | None, *, samples: int = 64) -> float:
    """Edges of a structure within ``cutoff``: exact for small ones, sampled else.

    Counts, for up to ``samples`` atoms spread evenly over the structure, the
    atoms (periodic images included, along periodic axes with a lattice
    vector) closer than ``cutoff``, and scales the mean to all atoms. The work
    is done in blocks of at most a few million distances, so the memory it
    takes does not grow with the structure or the number of images.

    Parameters
    ----------
    atoms : ase.Atoms
        The structure.
    cutoff : float or None
        Radius, Å; None or <= 0 gives 0.
    samples : int
        Atoms whose neighbours are counted (all of them when there are fewer).

    Returns
    -------
    float
        Ordered pairs ``(i, j)``, ``i != j`` or a periodic image, with
        ``|r_ij| < cutoff`` (what a full neighbour list holds); ``inf``, without
        counting, for a structure no model can run: non-finite positions or
        cell, or a periodic axis so thin (a near-singular cell) that the count
        would need more than :data:`MAX_COUNTED_IMAGES` images per side
        (:func:`~nvalchemi_ase.convert.check_images` refuses such a structure
        with its reason; call it first for the message).
    """
    count = len(atoms)
    if not cutoff or cutoff <= 0 or count == 0:
        return 0.0
    positions = np.asarray(atoms.positions, dtype=np.float64)
    cell = np.asarray(atoms.cell.array, dtype=np.float64)
    if not (np.isfinite(positions).all() and np.isfinite(cell).all()):
        return math.inf
    reach = _image_reach(cell, np.asarray(atoms.pbc, bool), cutoff)
    if reach is None:
        return math.inf
    shifts = _image_shifts(cell, np.asarray(atoms.pbc, bool), reach)
    picked = np.unique(
        np.linspace(0, count - 1, min(count, samples)).round().astype(int)
    )
    shifts_per_block = max(1, _BLOCK_FLOATS // (3 * count))
    total = 0
    for first in range(0, shifts.shape[0], shifts_per_block):
        images = positions[None, :, :] + shifts[first : first + shifts_per_block, None]
        centres_per_block = max(1, _BLOCK_FLOATS // images.size)
        for start in range(0, picked.size, centres_per_block):
            centres = positions[picked[start : start + centres_per_block]]
            d2 = ((images[None] - centres[:, None, None, :]) ** 2).sum(axis=-1)
            total += int((d2 < cutoff * cutoff).sum())
    total -= picked.size  # each sampled atom found itself once
    return total * count / picked.size


def _image_reach(cell: np.ndarray, pbc: np.ndarray, cutoff: float) -> np.ndarray | None:
    """Images per side on each periodic axis within ``cutoff``; None if too many."""
    periodic = pbc & np.any(cell != 0, axis=1)
    if not periodic.any():
        return np.zeros(0, dtype=int)
    try:
        reciprocal = np.linalg.pinv(cell[periodic]).T  # rows: dual of the vectors
    except np.linalg.LinAlgError:
        return None
    needed = cutoff * np.linalg.norm(reciprocal, axis=1)
    if not np.all(needed <= MAX_COUNTED_IMAGES):  # NaN too
        return None
    return np.ceil(needed).astype(int)


def _image_shifts(cell: np.ndarray, pbc: np.ndarray, reach: np.ndarray) -> np.ndarray:
    """Cartesian offsets (S, 3) of the periodic images ``reach`` allows."""
    periodic = pbc & np.any(cell != 0, axis=1)
    if not periodic.any():
        return np.zeros((1, 3))
    ranges = [np.arange(-n, n + 1) for n in reach]
    integers = np.stack(np.meshgrid(*ranges, indexing="ij"), axis=-1).reshape(
        -1, len(reach)
    )
    return integers @ cell[periodic]


# -- free memory ------------------------------------------------------------------


def available_memory(device: torch.device | str) -> int:
    """Bytes free for a new batch where ``device`` computes.

    Parameters
    ----------
    device : torch.device or str
        ``cpu``: the host's ``MemAvailable`` (``/proc/meminfo``, else
        ``os.sysconf``), lowered to a cgroup's memory limit when the process has
        one. ``cuda``: ``torch.cuda.mem_get_info`` plus what torch's caching
        allocator holds but does not use.

    Returns
    -------
    int
        Bytes.
    """
    resolved = torch.device(device)
    if resolved.type == "cuda":
        free, _ = torch.cuda.mem_get_info(resolved)
        cached = torch.cuda.memory_reserved(resolved) - torch.cuda.memory_allocated(
            resolved
        )
        return int(free + max(0, cached))
    host = _meminfo_available()
    limit = _cgroup_headroom()
    return int(host if limit is None else min(host, limit))


def _meminfo_available() -> int:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        text = ""
    found = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, flags=re.MULTILINE)
    if found:
        return int(found.group(1)) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _cgroup_headroom() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2 or v1), if limited.

    Usage counts the page cache; its inactive part, which the kernel reclaims
    before it kills, is counted as free.
    """
    for directory, limit_name, usage_name, cache_key in (
        ("", "memory.max", "memory.current", "inactive_file"),
        (
            "memory",
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file",
        ),
    ):
        root = Path("/sys/fs/cgroup", directory)
        try:
            limit = (root / limit_name).read_text().strip()
            usage = (root / usage_name).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            reclaimable = _stat_value(root / "memory.stat", cache_key)
            return max(0, int(limit) - int(usage) + reclaimable)
    return None


def _stat_value(path: Path, key: str) -> int:
    try:
        text = path.read_text()
    except OSError:
        return 0
    found = re.search(rf"^{key}\s+(\d+)", text, flags=re.MULTILINE)
    return int(found.group(1)) if found else 0


def format_bytes(value: float) -> str:
    """``value`` bytes as text with a decimal unit (``"1.5 GB"``)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"
