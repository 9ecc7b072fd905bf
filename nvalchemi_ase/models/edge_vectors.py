"""Forces and stress from edge vectors: the physics every edge-vector model shares.

A message-passing potential (NequIP, SevenNet, MACE, ...) sees a structure as a
graph whose edges are the vectors ``r_ij = x_j - x_i + S_ij · cell`` from a
centre atom i to each neighbour j within its cutoff (``S_ij`` the integer cell
image of the edge). Its energy ``E`` depends on positions and cell only through
those vectors, so one autograd pass with respect to them gives both

* the forces ``F_i = -∂E/∂x_i = Σ_j (∂E/∂r_ij - ∂E/∂r_ji)`` [V, 3], eV/Å, and
* the Cauchy stress ``σ = (1/V) Σ_ij sym(∂E/∂r_ij ⊗ r_ij)`` [B, 3, 3], eV/Å³,
  tensile positive (ASE's sign; ``-σ`` is the pressure tensor),

without differentiating the neighbour search or the cell. This module builds
that graph from an nvalchemi ``Batch`` and its COO neighbour list
(``neighbor_list`` [E, 2], ``neighbor_list_shifts`` [E, 3]), dropping padding
and edges longer than the cutoff (a list built with a Verlet skin gives the
same results), and turns a model's per-structure energy into the outputs
nvalchemi expects (:func:`edge_vector_outputs`).

A new edge-vector model supplies only ``energy_of(graph) -> [B]`` from
:class:`EdgeGraph`; ``models/sevennet/wrapper.py`` is the example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._compat import neighbor_list_cutoff
from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import batch_field

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = [
    "EdgeGraph",
    "EdgeVectorModule",
    "batch_field",
    "edge_gradient",
    "edge_graph",
    "edge_vector_outputs",
    "forces_from_edges",
    "stress_from_edges",
]


class EdgeVectorModule(torch.nn.Module):
    """The parts of nvalchemi's model interface every edge-vector model shares.

    Subclasses call :meth:`configure_edge_outputs` in ``__init__`` and
    compute their energy from :class:`EdgeGraph`; they publish no embeddings.
    Combined with nvalchemi's ``BaseModelMixin`` where the class is built.
    """

    model_config: Any
    cutoff: float

    def configure_edge_outputs(self, cutoff: float) -> None:
        """Set ``cutoff`` (Å) and the ``model_config`` of an edge-vector model.

        Energy, forces and stress (the last two by autograd through the edge
        vectors), periodic cells, a COO neighbour list at ``cutoff``; energy
        and forces active until stress is asked for.
        """
        base = import_quietly("nvalchemi.models.base")
        self.cutoff = float(cutoff)
        self.model_config = base.ModelConfig(
            outputs=frozenset({"energy", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            supports_pbc=True,
            neighbor_config=base.NeighborConfig(
                cutoff=self.cutoff, format=base.NeighborListFormat.COO
            ),
            active_outputs={"energy", "forces"},
        )

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        """Embeddings this model publishes: none.

        Returns
        -------
        dict
            Empty.
        """
        return {}

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        """Not available: this model publishes no embeddings.

        Parameters
        ----------
        data : Batch
            Ignored.
        **kwargs
            Ignored.

        Raises
        ------
        NotImplementedError
            Always.
        """
        raise NotImplementedError(f"{type(self).__name__} publishes no embeddings")


@dataclass
class EdgeGraph:
    """One batch as an edge-vector model sees it.

    Attributes
    ----------
    batch_idx : torch.Tensor
        [V] int64 structure of each atom.
    num_graphs : int
        B, the number of structures.
    edge_index : torch.Tensor
        [2, E] int64 (centre i, neighbour j), edges within the cutoff only.
    edge_graph : torch.Tensor
        [E] int64 structure of each edge.
    edge_vectors : torch.Tensor
        [E, 3] ``x_j - x_i + S_ij · cell``, Å, in the model's dtype.
    cell : torch.Tensor or None
        [B, 3, 3] cell (rows are lattice vectors), Å, in the model's dtype.
    """

    batch_idx: torch.Tensor
    num_graphs: int
    edge_index: torch.Tensor
    edge_graph: torch.Tensor
    edge_vectors: torch.Tensor
    cell: torch.Tensor | None


def edge_graph(
    data: Batch,
    *,
    cutoff: float,
    dtype: torch.dtype,
    need_cell: bool,
    model_name: str,
) -> EdgeGraph:
    """Build the edge graph of a batch from its COO neighbour list.

    Parameters
    ----------
    data : nvalchemi.data.Batch
        B structures with ``positions`` [V, 3] Å, ``batch_idx`` [V], a COO
        neighbour list built with a cutoff of at least ``cutoff``, and
        ``cell`` [B, 3, 3] Å for periodic structures.
    cutoff : float
        The model's interaction cutoff, Å; longer edges are dropped.
    dtype : torch.dtype
        The model's dtype; positions and cell are cast to it.
    need_cell : bool
        Whether a cell is required (stress).
    model_name : str
        The model's name, for error messages.

    Returns
    -------
    EdgeGraph
        The graph; ``edge_vectors`` do not require gradients yet.

    Raises
    ------
    ValueError
        Without a neighbour list, with one built to a shorter cutoff, or
        without a cell when ``need_cell``.
    """
    positions = data.positions.to(dtype)
    cell = batch_field(data, "cell")
    cell = None if cell is None else cell.to(dtype)
    if need_cell and cell is None:
        raise ValueError(f"{model_name} stress needs a cell; the batch has none")
    batch_idx = data.batch_idx.long()
    centre, neighbour, shifts = _pairs(data, positions.shape[0], cutoff, model_name)
    edge_of_graph = batch_idx[centre]
    offsets = None  # S_ij · cell, Å
    if shifts is not None and cell is not None:
        offsets = torch.einsum("ea,eab->eb", shifts.to(dtype), cell[edge_of_graph])
    inside = _within(positions, centre, neighbour, offsets, cutoff)
    centre, neighbour = centre[inside], neighbour[inside]
    vectors = positions[neighbour] - positions[centre]
    if offsets is not None:
        vectors = vectors + offsets[inside]
    return EdgeGraph(
        batch_idx=batch_idx,
        num_graphs=int(data.num_graphs),
        edge_index=torch.stack((centre, neighbour)),
        edge_graph=edge_of_graph[inside],
        edge_vectors=vectors,
        cell=cell,
    )


def edge_vector_outputs(
    data: Batch,
    energy_of: Callable[[EdgeGraph], torch.Tensor],
    *,
    cutoff: float,
    dtype: torch.dtype,
    want_forces: bool,
    want_stress: bool,
    keep_graph: bool,
    model_name: str,
) -> dict[str, torch.Tensor]:
    """Energy and, on demand, forces and stress of an edge-vector model.

    Parameters
    ----------
    data : nvalchemi.data.Batch
        The batch (see :func:`edge_graph`).
    energy_of : callable
        The model: :class:`EdgeGraph` to per-structure energy [B], eV.
    cutoff, dtype, model_name
        See :func:`edge_graph`.
    want_forces, want_stress : bool
        Which derivatives to compute.
    keep_graph : bool
        Keep the autograd graph of the derivatives (training, or positions
        that require gradients).

    Returns
    -------
    dict of str to torch.Tensor
        ``energy`` [B, 1] eV, ``forces`` [V, 3] eV/Å and ``stress``
        [B, 3, 3] eV/Å³ (tensile positive) when asked for, in the model dtype.
    """
    need_gradient = want_forces or want_stress
    with torch.set_grad_enabled(need_gradient or torch.is_grad_enabled()):
        graph = edge_graph(
            data,
            cutoff=cutoff,
            dtype=dtype,
            need_cell=want_stress,
            model_name=model_name,
        )
        if need_gradient:
            graph.edge_vectors.requires_grad_(True)
        energy = energy_of(graph)
        results = {"energy": energy.unsqueeze(-1)}
        if need_gradient:
            gradient = edge_gradient(energy, graph.edge_vectors, keep_graph=keep_graph)
            if want_forces:
                results["forces"] = forces_from_edges(
                    graph, gradient, num_atoms=data.positions.shape[0]
                )
            if want_stress:
                results["stress"] = stress_from_edges(graph, gradient)
    return results


def edge_gradient(
    energy: torch.Tensor, edge_vectors: torch.Tensor, *, keep_graph: bool
) -> torch.Tensor:
    """∂E/∂r_ij [E, 3], eV/Å (zero when no energy depends on an edge).

    Parameters
    ----------
    energy : torch.Tensor
        [B] per-structure energies, eV.
    edge_vectors : torch.Tensor
        [E, 3] edge vectors that require gradients, Å.
    keep_graph : bool
        Build a differentiable gradient (``create_graph``).

    Returns
    -------
    torch.Tensor
        [E, 3] gradient.
    """
    if not energy.requires_grad:
        # no edge in the whole batch (isolated atoms): E does not depend on r_ij
        return torch.zeros_like(edge_vectors)
    (gradient,) = torch.autograd.grad(
        energy.sum(),
        edge_vectors,
        create_graph=keep_graph,
        retain_graph=keep_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    return gradient


def forces_from_edges(
    graph: EdgeGraph, gradient: torch.Tensor, *, num_atoms: int
) -> torch.Tensor:
    """F_i = -∂E/∂x_i [V, 3], eV/Å, from r_ij = x_j - x_i + shift.

    Parameters
    ----------
    graph : EdgeGraph
        The graph the energy was computed on.
    gradient : torch.Tensor
        [E, 3] ∂E/∂r_ij, eV/Å.
    num_atoms : int
        V, the number of atoms in the batch.

    Returns
    -------
    torch.Tensor
        [V, 3] forces.
    """
    centre, neighbour = graph.edge_index
    forces = torch.zeros((num_atoms, 3), dtype=gradient.dtype, device=gradient.device)
    forces = forces.index_add(0, centre, gradient)
    return forces.index_add(0, neighbour, gradient, alpha=-1)


def stress_from_edges(graph: EdgeGraph, gradient: torch.Tensor) -> torch.Tensor:
    """σ = (1/V) Σ sym(∂E/∂r ⊗ r) [B, 3, 3], eV/Å³, tensile positive.

    Parameters
    ----------
    graph : EdgeGraph
        The graph the energy was computed on (with a cell).
    gradient : torch.Tensor
        [E, 3] ∂E/∂r_ij, eV/Å.

    Returns
    -------
    torch.Tensor
        [B, 3, 3] stress; for a structure without three lattice vectors it
        uses the batch's stand-in cell and is not physical.
    """
    if graph.cell is None:
        raise ValueError("stress needs a cell; the graph has none")
    per_edge = gradient.unsqueeze(2) * graph.edge_vectors.unsqueeze(1)
    virial = torch.zeros(
        (graph.num_graphs, 3, 3), dtype=per_edge.dtype, device=per_edge.device
    )
    virial = virial.index_add(0, graph.edge_graph, per_edge)
    volume = torch.linalg.det(graph.cell).abs().reshape(-1, 1, 1)
    return 0.5 * (virial + virial.mT) / volume


def _pairs(
    data: Batch, num_atoms: int, cutoff: float, model_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Centre and neighbour indices [E] and cell shifts [E, 3] of the list."""
    pairs = batch_field(data, "neighbor_list")
    if pairs is None:
        raise ValueError(
            f"{model_name} needs a COO neighbour list on the batch: call "
            "nvalchemi.neighbors.compute_neighbors(batch, "
            "config=model.model_config.neighbor_config) first"
        )
    built = neighbor_list_cutoff(data)
    if built is not None and built < cutoff - 1e-6:
        raise ValueError(
            f"the neighbour list was built to {built} Å; {model_name} needs "
            f"at least {cutoff} Å"
        )
    pairs = pairs.long()
    centre, neighbour = pairs[:, 0], pairs[:, 1]
    valid = (centre < num_atoms) & (neighbour < num_atoms)  # drop padding
    shifts = batch_field(data, "neighbor_list_shifts")
    return (
        centre[valid],
        neighbour[valid],
        None if shifts is None else shifts[valid],
    )


def _within(
    positions: torch.Tensor,
    centre: torch.Tensor,
    neighbour: torch.Tensor,
    offsets: torch.Tensor | None,
    cutoff: float,
) -> torch.Tensor:
    """[E] bool: edges no longer than ``cutoff`` (a list with a skin has more)."""
    with torch.no_grad():
        vectors = positions[neighbour] - positions[centre]
        if offsets is not None:
            vectors = vectors + offsets
        return (vectors * vectors).sum(dim=1) <= cutoff * cutoff
