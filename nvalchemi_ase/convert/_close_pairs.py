"""Atoms closer than :data:`MIN_DISTANCE`, periodic images included.

A spatial hash on shifted grids over every structure of a batch at once (no
per-atom Python loop); structures too thin for it are searched in a supercell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from nvalchemi_ase.convert._common import (
    MIN_DISTANCE,
    StructureError,
)

#: Shifted grids of the distance check: D + 1 grids, shifted by 1/(D + 1) of a bin
#: along every axis, put every pair closer than 1/(D + 1) of a bin into one bin
#: of at least one grid (in D = 3 dimensions; each axis can separate the pair in
#: at most one grid).
_GRIDS = 4


#: Structures whose periodic heights are all above this (Å) are searched with
#: fractional coordinates wrapped once: the close image of a pair is then the
#: only one within half a cell, and no atom is near its own image.
_THIN_HEIGHT = 2.0 * MIN_DISTANCE


@dataclass
class _Close:
    """Two atoms (or an atom and its own image) closer than ``MIN_DISTANCE``."""

    structure: int
    first: int
    second: int
    distance: float
    periodic: bool
    vector: npt.NDArray[np.float64] | None = None

    def error(self) -> StructureError:
        if self.first == self.second:
            vector = np.round(np.asarray(self.vector), 6).tolist()
            return StructureError(
                self.structure,
                "cell",
                f"atom {self.first} is {self.distance:.3g} Å from its own periodic "
                f"image: the lattice holds the vector {vector} Å, shorter than "
                f"the minimum distance of {MIN_DISTANCE} Å between atoms",
                "the cell is too small or its periodic vectors are (nearly) "
                "parallel; set the intended lattice vectors",
            )
        image = " (a periodic image of it)" if self.periodic else ""
        return StructureError(
            self.structure,
            f"positions[{self.second}]",
            f"atom {self.second} is {self.distance:.3g} Å from atom "
            f"{self.first}{image}, closer than the minimum of {MIN_DISTANCE} Å",
            "atoms this close are almost always a duplicated site (e.g. a CIF "
            f"with partial occupancies read as full sites); remove one (del "
            f"atoms[{self.second}], or ase.geometry.get_duplicate_atoms(atoms, "
            f"cutoff={MIN_DISTANCE}, delete=True) for every such pair)",
        )


def _check_distances(
    positions: npt.NDArray[np.float64],
    cell: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    ptr: npt.NDArray[np.int64],
) -> None:
    """Raise for the first structure with atoms closer than :data:`MIN_DISTANCE`.

    Periodic images count, an atom's own included. All structures are searched
    at once with shifted grids (:func:`_close_by_grids`, a few sorts of the
    V atoms); a structure with a periodic height below ``2 * MIN_DISTANCE`` is
    first given a Minkowski-reduced basis of the same lattice, and searched
    as a supercell if it is still that thin.
    """
    frames = _search_frames(cell, pbc)
    found: list[_Close] = []
    for index in np.flatnonzero(_thin(frames, pbc)):
        frames[index], own_image = _reduced_frame(int(index), frames[index], pbc[index])
        if own_image is not None:
            found.append(own_image)
    thin = _thin(frames, pbc)
    owner = np.repeat(np.arange(len(cell)), np.diff(ptr))
    by_grid = _close_by_grids(positions, frames, pbc, ptr, owner, ~thin[owner])
    if by_grid is not None:
        found.append(by_grid)
    for index in np.flatnonzero(thin):
        if found and min(c.structure for c in found) <= index:
            break
        atoms_slice = slice(ptr[index], ptr[index + 1])
        close = _close_in_supercell(
            int(index), positions[atoms_slice], frames[index], pbc[index]
        )
        if close is not None:
            found.append(close)
            break
    if found:
        raise min(found, key=lambda close: close.structure).error()


def _search_frames(
    cell: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    """Return each structure's periodic lattice vectors and orthonormal others.

    Rows on periodic axes are the cell's; the others are unit vectors orthogonal
    to them and to each other, so fractional coordinates along non-periodic
    axes are Å (the user's vectors there may be zero or arbitrary).
    """
    frames = np.where(pbc[:, :, None], cell, 0.0)
    n_periodic = pbc.sum(axis=1)
    frames[n_periodic == 0] = np.eye(3)
    slabs, axis = np.nonzero(~pbc & (n_periodic == 2)[:, None])
    if slabs.size:
        normal = np.cross(cell[slabs, (axis + 1) % 3], cell[slabs, (axis + 2) % 3])
        frames[slabs, axis] = normal / np.linalg.norm(normal, axis=1, keepdims=True)
    wires, axis = np.nonzero(pbc & (n_periodic == 1)[:, None])
    if wires.size:
        along = cell[wires, axis] / np.linalg.norm(
            cell[wires, axis], axis=1, keepdims=True
        )
        helper = np.eye(3)[np.argmin(np.abs(along), axis=1)]
        first = np.cross(along, helper)
        first /= np.linalg.norm(first, axis=1, keepdims=True)
        frames[wires, (axis + 1) % 3] = first
        frames[wires, (axis + 2) % 3] = np.cross(along, first)
    return frames


def _heights(cells: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Distance between the lattice planes of each axis, Å, shape (B, 3)."""
    volume = np.abs(np.linalg.det(cells))
    faces = np.cross(np.roll(cells, -1, axis=1), np.roll(cells, -2, axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return volume[:, None] / np.linalg.norm(faces, axis=2)


def _thin(
    frames: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    return np.any((_heights(frames) <= _THIN_HEIGHT) & pbc, axis=1)


def _reduced_frame(
    index: int, frame: npt.NDArray[np.float64], pbc: npt.NDArray[np.bool_]
) -> tuple[npt.NDArray[np.float64], _Close | None]:
    """Return a Minkowski-reduced basis of the same lattice, and any own-image pair.

    The reduced basis holds the lattice's shortest vector, so an atom is closer
    than ``MIN_DISTANCE`` to its own image exactly when a periodic row is.
    """
    from ase.geometry import minkowski_reduce

    reduced, _ = minkowski_reduce(frame, pbc)
    lengths = np.where(pbc, np.linalg.norm(reduced, axis=1), np.inf)
    axis = int(np.argmin(lengths))
    if lengths[axis] < MIN_DISTANCE:
        own = _Close(index, 0, 0, float(lengths[axis]), True, reduced[axis])
        return reduced, own
    return reduced, None


def _close_by_grids(
    positions: npt.NDArray[np.float64],
    frames: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    ptr: npt.NDArray[np.int64],
    owner: npt.NDArray[np.int64],
    include: npt.NDArray[np.bool_],
) -> _Close | None:
    """Return the first pair closer than ``MIN_DISTANCE`` (``include``d atoms).

    Fractional coordinates (wrapped on periodic axes) are binned into cells of
    height ``_GRIDS * MIN_DISTANCE`` or more; every close pair shares a bin in
    one of the ``_GRIDS`` shifted grids. Per grid, atoms alone in their hash
    bucket are dropped (one ``bincount``), the rest are sorted by bin and
    neighbours in that order compared. Real structures have at most one or two
    atoms per bin, so almost no distance is computed.
    """
    if len(frames) == 1:  # one structure: broadcast instead of per-atom copies

        def per_atom(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return values

        fractional = positions @ np.linalg.inv(frames[0])
    else:

        def per_atom(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return values[owner]

        inverse = np.linalg.inv(frames)[owner]
        fractional = np.einsum("vi,vij->vj", positions, inverse)
    periodic = per_atom(pbc)
    fractional = np.where(periodic, fractional - np.floor(fractional), fractional)
    per_unit = _heights(frames) / (_GRIDS * MIN_DISTANCE)
    bins = np.where(pbc, np.maximum(np.floor(per_unit), 1.0), per_unit)
    scaled = fractional * per_atom(bins)
    starts = ptr[:-1]
    lowest = np.floor(np.minimum.reduceat(scaled, starts, axis=0))
    scaled = np.where(periodic, scaled, scaled - per_atom(lowest))  # all >= 0
    span = np.where(pbc, bins, np.floor(np.maximum.reduceat(scaled, starts)) + 2)
    packed = float(np.prod(span, axis=1).sum()) < 2.0**62
    span_b = span.astype(np.int64)
    base_b = np.concatenate([[0], np.cumsum(np.prod(span_b, axis=1))[:-1]])
    weight_b = np.stack([span_b[:, 1] * span_b[:, 2], span_b[:, 2]], axis=1)
    span_v, weight_v, base_v = per_atom(span_b), per_atom(weight_b), per_atom(base_b)
    atoms = np.arange(len(positions)) if include.all() else np.flatnonzero(include)
    close: _Close | None = None
    grid = 0
    while grid < _GRIDS and atoms.size >= 2:
        chosen = None if atoms.size == len(positions) else atoms
        # truncation is floor here (scaled >= 0); a periodic axis' last bin wraps
        cells = (_rows(scaled, chosen) + grid / _GRIDS).astype(np.int64)
        spans = _rows(span_v, chosen)
        cells -= spans * (cells >= spans)
        if packed:
            weights = _rows(weight_v, chosen)
            keys = (
                _rows(base_v, chosen)
                + cells[:, 0] * weights[:, 0]
                + cells[:, 1] * weights[:, 1]
                + cells[:, 2]
            )
            shared = _sharing_a_bucket(keys)
            order = shared[np.argsort(keys[shared])]
            sorted_keys = keys[order, None]
        else:  # astronomically many bins: compare (structure, bin) rows
            rows = np.column_stack([owner[atoms], cells])
            order = np.lexsort(rows.T[::-1])
            sorted_keys = rows[order]
        found = _scan_sorted(atoms[order], sorted_keys, fractional, pbc, frames, owner)
        if found is None:
            grid += 1
        else:  # look again, for a close pair in an earlier structure
            close = _pair(*found, positions, ptr)
            atoms = atoms[owner[atoms] < close.structure]
    return close


def _rows(
    values: npt.NDArray[Any], atoms: npt.NDArray[np.int64] | None
) -> npt.NDArray[Any]:
    """Select ``atoms`` from per-atom ``values`` (one shared row is kept as is)."""
    return values if atoms is None or len(values) == 1 else values[atoms]


def _sharing_a_bucket(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Return the positions of keys whose hash bucket holds another key too.

    Equal keys share a bucket, so no pair of equal keys is lost; with four
    buckets per key about a fifth of distinct keys collide.
    """
    buckets = keys % (4 * len(keys) + 1)
    counts = np.bincount(buckets)
    return np.flatnonzero(counts[buckets] > 1)


def _scan_sorted(
    atoms: npt.NDArray[np.int64],
    keys: npt.NDArray[np.int64],
    fractional: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
    frames: npt.NDArray[np.float64],
    owner: npt.NDArray[np.int64],
) -> tuple[int, int, int, float] | None:
    """Return the first close pair (structure, atom, atom, Å) sharing a bin.

    ``atoms`` are sorted by bin (``keys``); two atoms of one bin are ``step``
    apart in that order for some ``step`` below the bin's size.
    """
    for step in range(1, len(atoms)):
        same = (keys[step:] == keys[:-step]).all(axis=1)
        if not same.any():
            return None
        first, second = atoms[:-step][same], atoms[step:][same]
        difference = fractional[second] - fractional[first]
        structure = owner[first]
        difference = np.where(
            pbc[structure], difference - np.round(difference), difference
        )
        vectors = np.einsum("pi,pij->pj", difference, frames[structure])
        distance = np.linalg.norm(vectors, axis=1)
        bad = np.flatnonzero(distance < MIN_DISTANCE)
        if bad.size:
            low = np.minimum(first[bad], second[bad])
            high = np.maximum(first[bad], second[bad])
            pick = np.lexsort((low, high, owner[low]))[0]
            return (
                int(owner[low[pick]]),
                int(low[pick]),
                int(high[pick]),
                float(distance[bad[pick]]),
            )
    return None


def _pair(
    structure: int,
    first: int,
    second: int,
    distance: float,
    positions: npt.NDArray[np.float64],
    ptr: npt.NDArray[np.int64],
) -> _Close:
    """Name a close pair of global atom indices within its structure."""
    direct = float(np.linalg.norm(positions[second] - positions[first]))
    return _Close(
        structure,
        int(first - ptr[structure]),
        int(second - ptr[structure]),
        distance,
        periodic=abs(direct - distance) > 1e-9,
    )


def _close_in_supercell(
    index: int,
    positions: npt.NDArray[np.float64],
    frame: npt.NDArray[np.float64],
    pbc: npt.NDArray[np.bool_],
) -> _Close | None:
    """Find the close pair of one very thin structure through a supercell.

    The supercell repeats the (reduced) cell until every periodic height
    exceeds ``2 * MIN_DISTANCE``; each image of an atom near another one (or
    near itself) is then a copy in the supercell, found by the shifted grids.
    """
    repeats = np.where(pbc, np.floor(_THIN_HEIGHT / _heights(frame[None])[0]) + 1, 1)
    grid = np.stack(
        np.meshgrid(*(np.arange(int(r)) for r in repeats), indexing="ij"), axis=-1
    ).reshape(-1, 3)
    copies = (positions[None, :, :] + (grid @ frame)[:, None, :]).reshape(-1, 3)
    count = len(positions)
    close = _close_by_grids(
        copies,
        (frame * repeats[:, None])[None],
        pbc[None],
        np.array([0, len(copies)]),
        np.zeros(len(copies), dtype=np.int64),
        np.ones(len(copies), dtype=bool),
    )
    if close is None:
        return None
    first, second = close.first % count, close.second % count
    vector = copies[close.second] - copies[close.first]
    if first > second:
        first, second = second, first
    return _Close(index, first, second, close.distance, True, vector)
