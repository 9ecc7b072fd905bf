"""Radial distribution functions per structure, total and per element pair.

Matches ASE's :func:`ase.geometry.rdf.get_rdf` (ASE ≥ 3.27 conventions, the same
as LAMMPS ``compute rdf``): bins of width ``dr = rmax / nbins`` with a distance
``d`` in bin ``ceil(d / dr)`` (``0 < d <= rmax``), centres ``(k - 1/2) dr``, and::

    g(r)    = n_pairs(r) / (N · (N/V) · shell(r))            (ordered pairs)
    g_ab(r) = n_ab(r)    / (N_a · (N_b/V) · shell(r))          (i of a, j of b)

with ``shell(r)`` the exact volume of the spherical shell of the bin, so that
``g_ab = g_ba`` and ``g = Σ_ab c_a c_b g_ab``. Each frame is normalised by its own
volume and the frames are averaged. Distances are minimum-image distances over
the periodic axes; as in ASE, ``rmax`` may be at most half of the cell's
smallest width along a periodic axis (each pair then has at most one image
within ``rmax``).

All pairs of a structure are enumerated (``N(N-1)/2`` per frame, chunked), so
the cost grows as N²; the same kernel runs on a whole batch at once in
:class:`~nvalchemi_ase.analysis.observers.RDFObserver`. Units: Å.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from ase.data import chemical_symbols

from nvalchemi_ase.analysis.frames import Frames, FramesLike, load_trajectories

__all__ = [
    "PairTable",
    "RDFResult",
    "check_rmax",
    "pair_counts",
    "pair_table",
    "radial_distribution",
    "rdf_from_counts",
]

FloatArray = npt.NDArray[np.float64]

#: Pairs per chunk of the distance kernel.
_PAIR_CHUNK = 1 << 18


@dataclass(frozen=True)
class RDFResult:
    """Time-averaged RDFs of one structure.

    Attributes
    ----------
    label : str
        The structure.
    r : numpy.ndarray, shape (nbins,)
        Bin centres, Å.
    g : numpy.ndarray, shape (nbins,)
        Total g(r) (dimensionless).
    partial : dict of (str, str) to numpy.ndarray, shape (nbins,)
        ``g_ab(r)`` for every element pair ``a <= b`` (by atomic number).
    n_frames : int
        Frames averaged.
    rmax : float
        Largest distance, Å.
    """

    label: str
    r: FloatArray
    g: FloatArray
    partial: dict[tuple[str, str], FloatArray]
    n_frames: int
    rmax: float

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form for JSON (partials keyed ``"A-B"``).

        Returns
        -------
        dict
            Every field, arrays as lists.
        """
        return {
            "label": self.label,
            "n_frames": self.n_frames,
            "rmax_A": self.rmax,
            "r_A": self.r.tolist(),
            "g": self.g.tolist(),
            "partial": {f"{a}-{b}": v.tolist() for (a, b), v in self.partial.items()},
        }


@dataclass(frozen=True)
class PairTable:
    """Every unordered pair of atoms within each structure of a batch.

    Attributes
    ----------
    first, second : torch.Tensor, shape (P,), long
        Global atom indices, ``first < second``, same structure.
    structure : torch.Tensor, shape (P,), long
        Structure of each pair.
    kind : torch.Tensor, shape (P,), long
        Element-pair type of each pair (index into ``elements``).
    elements : list of tuple of str
        ``(a, b)`` of each type, ``Z_a <= Z_b``.
    type_structure : numpy.ndarray, shape (K,), int
        Structure of each type.
    centers : numpy.ndarray, shape (K,)
        ``N_a · N_b`` of each type (the normaliser without volume and shell).
    ordered : numpy.ndarray, shape (K,)
        2 for ``a == b`` (both orders of each pair), else 1.
    natoms : numpy.ndarray, shape (B,)
        Atoms per structure.
    """

    first: torch.Tensor
    second: torch.Tensor
    structure: torch.Tensor
    kind: torch.Tensor
    elements: list[tuple[str, str]]
    type_structure: npt.NDArray[np.int64]
    centers: FloatArray
    ordered: FloatArray
    natoms: FloatArray


def pair_table(
    numbers: Sequence[npt.NDArray[np.integer]], device: torch.device | str = "cpu"
) -> PairTable:
    """Enumerate the pairs of consecutive structures (atoms stacked in order).

    Parameters
    ----------
    numbers : sequence of numpy.ndarray, each shape (N_i,)
        Atomic numbers of each structure.
    device : torch.device or str
        Device of the index tensors.

    Returns
    -------
    PairTable
        The pairs and their types.
    """
    first, second, structure, kind = [], [], [], []
    elements: list[tuple[str, str]] = []
    type_structure, centers, ordered = [], [], []
    offset = 0
    for index, values in enumerate(numbers):
        values = np.asarray(values)
        unique, counts = np.unique(values, return_counts=True)
        local_i, local_j = np.triu_indices(len(values), k=1)
        zi, zj = values[local_i], values[local_j]
        low = np.searchsorted(unique, np.minimum(zi, zj))
        high = np.searchsorted(unique, np.maximum(zi, zj))
        n_unique = len(unique)
        # type id of (low, high) with low <= high, row-major upper triangle
        tri_index = np.full((n_unique, n_unique), -1)
        rows, cols = np.triu_indices(n_unique)
        tri_index[rows, cols] = np.arange(len(rows)) + len(elements)
        first.append(local_i + offset)
        second.append(local_j + offset)
        structure.append(np.full(len(local_i), index))
        kind.append(tri_index[low, high])
        for a, b in zip(rows, cols, strict=True):
            elements.append((chemical_symbols[unique[a]], chemical_symbols[unique[b]]))
            type_structure.append(index)
            centers.append(float(counts[a] * counts[b]))
            ordered.append(2.0 if a == b else 1.0)
        offset += len(values)

    def cat(parts: list[npt.NDArray[Any]]) -> torch.Tensor:
        return torch.as_tensor(np.concatenate(parts).astype(np.int64), device=device)

    return PairTable(
        first=cat(first),
        second=cat(second),
        structure=cat(structure),
        kind=cat(kind),
        elements=elements,
        type_structure=np.asarray(type_structure, dtype=np.int64),
        centers=np.asarray(centers),
        ordered=np.asarray(ordered),
        natoms=np.asarray([len(v) for v in numbers], dtype=np.float64),
    )


def check_rmax(
    cells: FloatArray, pbc: npt.NDArray[np.bool_], rmax: float, label: str
) -> None:
    """Raise unless ``rmax`` fits in every cell (ASE's rule).

    Parameters
    ----------
    cells : numpy.ndarray, shape (T, 3, 3)
        Cells, Å.
    pbc : numpy.ndarray, shape (3,)
        Periodic axes.
    rmax : float
        Largest distance, Å.
    label : str
        Names the structure in the message.
    """
    if not (np.isfinite(rmax) and rmax > 0):
        raise ValueError(f"rmax must be positive, got {rmax}")
    volume = np.abs(np.linalg.det(cells))
    for axis in np.flatnonzero(pbc):
        cross = np.cross(cells[:, (axis + 1) % 3], cells[:, (axis + 2) % 3])
        width = float((volume / np.linalg.norm(cross, axis=1)).min())
        if width < 2 * rmax:
            raise ValueError(
                f"{label}: rmax={rmax:g} Å is more than half the cell width "
                f"along axis {axis} ({width:.3f} Å); use rmax <= {width / 2:.3f} "
                "or a larger cell"
            )


def pair_counts(
    displacement: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    kind: torch.Tensor,
    weight: torch.Tensor,
    n_types: int,
    rmax: float,
    nbins: int,
) -> torch.Tensor:
    """Weighted histogram of minimum-image pair distances per pair type.

    Parameters
    ----------
    displacement : torch.Tensor, shape (P, 3)
        ``r_j - r_i``, Å.
    cell : torch.Tensor, shape (P, 3, 3)
        Each pair's cell, Å.
    pbc : torch.Tensor, shape (P, 3), bool
        Each pair's periodic axes.
    kind : torch.Tensor, shape (P,), long
        Type of each pair.
    weight : torch.Tensor, shape (P,)
        Weight of each pair (its frame's volume).
    n_types : int
        Number of types K.
    rmax : float
        Largest distance, Å.
    nbins : int
        Bins.

    Returns
    -------
    torch.Tensor, shape (K, nbins), float64
        Σ weight of the pairs in each bin (ASE's ``ceil(d/dr)`` binning).
    """
    device = displacement.device
    width = nbins + 2  # bin 0: d = 0, bins 1..nbins, bin nbins+1: beyond rmax
    out = torch.zeros(n_types * width, dtype=torch.float64, device=device)
    dr = rmax / nbins
    for start in range(0, displacement.shape[0], _PAIR_CHUNK):
        part = slice(start, start + _PAIR_CHUNK)
        d = displacement[part].to(torch.float64)
        h = cell[part].to(torch.float64)
        frac = torch.linalg.solve(h.transpose(-1, -2), d[..., None])[..., 0]
        # The wrapped image (fractions in [-1/2, 1/2] along periodic axes) is
        # the only one that can lie within rmax when rmax is at most half of
        # every periodic width (the callers' precondition): an image within
        # rmax has |frac_a| = |v . b_a| <= |v| / w_a < 1/2 on every axis a.
        # Farther pairs land beyond rmax either way.
        frac = torch.where(pbc[part], frac - torch.round(frac), frac)
        distance = torch.linalg.vector_norm(torch.einsum("pi,pij->pj", frac, h), dim=-1)
        index = torch.ceil(distance / dr).long().clamp(0, nbins + 1)
        flat = kind[part] * width + index  # no boolean mask: no host sync
        out.index_add_(0, flat, weight[part].to(torch.float64))
    return out.reshape(n_types, width)[:, 1 : nbins + 1]


def shell_volumes(rmax: float, nbins: int) -> FloatArray:
    """Exact volumes of the spherical shells of the bins, Å³, shape (nbins,)."""
    edges = np.linspace(0.0, rmax, nbins + 1)
    return 4.0 / 3.0 * np.pi * (edges[1:] ** 3 - edges[:-1] ** 3)


def rdf_from_counts(
    counts: FloatArray,
    table: PairTable,
    n_frames: FloatArray,
    rmax: float,
    nbins: int,
    labels: Sequence[str],
) -> list[RDFResult]:
    """Normalise accumulated volume-weighted pair counts into RDFs.

    Parameters
    ----------
    counts : numpy.ndarray, shape (K, nbins)
        Σ over frames of ``V_frame ×`` unordered pair counts per type.
    table : PairTable
        The pairs' types.
    n_frames : numpy.ndarray, shape (B,)
        Frames accumulated per structure.
    rmax : float
        Largest distance, Å.
    nbins : int
        Bins.
    labels : sequence of str
        Structure names.

    Returns
    -------
    list of RDFResult
        One per structure.
    """
    shells = shell_volumes(rmax, nbins)
    frames_of_type = n_frames[table.type_structure]
    ordered_counts = counts * table.ordered[:, None]
    partial = ordered_counts / (
        frames_of_type[:, None] * table.centers[:, None] * shells[None]
    )
    centres = (np.arange(nbins, dtype=np.float64) + 0.5) * (rmax / nbins)
    results = []
    for index, label in enumerate(labels):
        types = np.flatnonzero(table.type_structure == index)
        natoms = table.natoms[index]
        total = (
            2.0
            * counts[types].sum(axis=0)
            / (n_frames[index] * natoms * natoms * shells)
        )
        results.append(
            RDFResult(
                label=label,
                r=centres,
                g=total,
                partial={table.elements[k]: partial[k] for k in types},
                n_frames=int(n_frames[index]),
                rmax=float(rmax),
            )
        )
    return results


def radial_distribution(
    trajectories: Sequence[FramesLike],
    rmax: float,
    nbins: int,
    *,
    frame_chunk: int | None = None,
) -> list[RDFResult]:
    """Time-averaged total and partial RDFs of every structure.

    Parameters
    ----------
    trajectories : sequence of (path, list of Atoms, or Frames)
        One entry per structure (see
        :func:`~nvalchemi_ase.analysis.frames.load_trajectories`); each frame
        needs a cell of rank 3 (its volume normalises g).
    rmax : float
        Largest distance, Å (at most half the smallest periodic cell width).
    nbins : int
        Number of bins.
    frame_chunk : int, optional
        Frames evaluated together (default: as many as keep ~2²⁰ pairs).

    Returns
    -------
    list of RDFResult
        One per structure, in input order; equal to ASE's
        ``get_rdf(frames, rmax, nbins)`` (and ``elements=(a, b)`` for partials).
    """
    if int(nbins) != nbins or nbins < 1:
        raise ValueError(f"nbins must be a positive integer, got {nbins}")
    loaded = load_trajectories(trajectories, need_interval=False)
    for index, frames in enumerate(loaded):
        if not frames.full_cell:
            raise ValueError(
                f"trajectories[{index}] ({frames.label}): the RDF needs a cell "
                "with three lattice vectors in every frame (its volume sets the "
                "density); set one with atoms.set_cell"
            )
        check_rmax(frames.cells, frames.pbc, rmax, f"trajectories[{index}]")
    return [_one_rdf(frames, rmax, int(nbins), frame_chunk) for frames in loaded]


def _one_rdf(
    frames: Frames, rmax: float, nbins: int, frame_chunk: int | None
) -> RDFResult:
    table = pair_table([frames.numbers])
    n_pairs = max(1, int(table.first.numel()))
    chunk = frame_chunk or max(1, (1 << 20) // n_pairs)
    positions = torch.as_tensor(frames.positions)
    cells = torch.as_tensor(frames.cells)
    pbc = torch.as_tensor(frames.pbc)
    volume = torch.linalg.det(cells).abs()
    n_types = len(table.elements)
    counts = torch.zeros(n_types, nbins, dtype=torch.float64)
    for start in range(0, frames.n_frames, chunk):
        part = slice(start, start + chunk)
        count = positions[part].shape[0]
        displacement = (
            positions[part][:, table.second] - positions[part][:, table.first]
        )
        cell = cells[part][:, None].expand(-1, n_pairs, -1, -1)
        counts += pair_counts(
            displacement.reshape(-1, 3),
            cell.reshape(-1, 3, 3),
            pbc.expand(count * n_pairs, 3),
            table.kind.repeat(count),
            volume[part].repeat_interleave(n_pairs),
            n_types,
            rmax,
            nbins,
        )
    return rdf_from_counts(
        counts.numpy(),
        table,
        np.array([frames.n_frames], dtype=np.float64),
        rmax,
        nbins,
        [frames.label],
    )[0]
