"""SevenNet-0 as a batched nvalchemi model.

SevenNet-0 (``sevenn`` package, MIT licence; "7net-0", 11 Jul 2024) is a
universal interatomic potential (NequIP-style E(3)-equivariant message passing,
5 interaction layers, 89 elements, trained on MPtrj at the PBE/PBE+U level, 5 Å
cutoff). Its weights ship inside the ``sevenn`` wheel, so loading needs no
network. ``sevenn``'s own ASE calculator evaluates one structure per call; the
wrapper built here evaluates a whole nvalchemi ``Batch`` in one forward pass:

* the graph comes from nvalchemi's neighbour list (COO ``neighbor_list`` [E, 2]
  with integer ``neighbor_list_shifts`` [E, 3]); edges longer than the model's
  cutoff are dropped, so a list built with a Verlet skin gives the same results;
* edge vectors ``r_ij = x_j - x_i + S_ij · cell`` feed SevenNet's layers, whose
  per-atom energies are summed per structure;
* forces and stress come from one autograd pass with respect to the edge
  vectors: ``F_i = Σ_j (∂E/∂r_ij - ∂E/∂r_ji)`` and the tensile-positive Cauchy
  stress ``σ = (1/V) Σ_ij sym(∂E/∂r_ij ⊗ r_ij)`` (ASE's sign).

Two changes keep the batched pass at least as fast as sevenn's one-structure
calculator on the CPU, where the cost is linear in the number of edges: the
convolutions run over edges in tiles of :data:`CONVOLUTION_TILE_BYTES` (whole
batch temporaries of hundreds of MB cost page faults on every call), and e3nn's
per-path column slices get a one-concatenation backward
(:func:`_merge_column_slices`). Memory still grows with the edges of the whole
batch: about 250 kB per edge in float32 (8 GB for 784 atoms, 33 000 edges).

``import nvalchemi_ase.models`` does not import ``sevenn`` or ``nvalchemi``:
both are imported (silently) when :func:`sevennet_0` is first called.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import itertools
import operator
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nvalchemi_ase._quiet import import_quietly

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "CONVOLUTION_TILE_BYTES",
    "SEVENNET_0_CUTOFF",
    "SEVENNET_EXTRA",
    "sevennet_0",
]

#: Interaction cutoff of SevenNet-0, Å.
SEVENNET_0_CUTOFF = 5.0
#: How to install the optional dependency.
SEVENNET_EXTRA = 'pip install "nvalchemi-ase[sevennet]"'

# Module names of sevenn's ``AtomGraphSequential`` that this wrapper replaces:
# the one-hot embedding hard-codes float32 (``.float()``), the energy reduction
# sizes its output from ``batch.max()``, and the force output is recomputed here
# so that stress follows nvalchemi's convention and is computed only on demand.
_ONE_HOT = "onehot_idx_to_onehot"
_REPLACED = frozenset({_ONE_HOT, "reduce_total_enegy", "force_output"})
_ATOMIC_ENERGY_KEY = "atomic_energy"
_MAX_ATOMIC_NUMBER = 118
#: Size of one tile of per-edge messages in the convolutions, bytes. SevenNet's
#: messages are up to 3136 numbers wide per edge; for a whole batch at once they
#: reach hundreds of MB, which the C allocator serves with fresh zeroed pages on
#: every call (half of the time went to page faults in a 784-atom batch on the
#: CPU). Tiles of this size keep every temporary below glibc's 32 MB mmap
#: threshold, so memory is reused between tiles and calls.
CONVOLUTION_TILE_BYTES = 16 * 2**20


def sevennet_0() -> BaseModelMixin:
    """SevenNet-0 (11 Jul 2024), a universal potential for 89 elements, batched.

    Returns
    -------
    BaseModelMixin
        A ``SevenNetWrapper`` on the CPU in float32 (SevenNet's native
        precision; ``.to(dtype=torch.float64)`` evaluates the same weights in
        float64). Outputs: ``energy`` [B, 1] eV, ``forces`` [V, 3] eV/Å and,
        opt-in, ``stress`` [B, 3, 3] eV/Å³ (tensile positive, as ASE). Active by
        default: energy and forces. Neighbour list: COO, full, cutoff 5 Å.

    Raises
    ------
    ImportError
        If ``sevenn`` (or one of its dependencies) is not installed; the message
        names the extra to install.
    FileNotFoundError
        If the installed ``sevenn`` does not contain the SevenNet-0 checkpoint
        (it is never downloaded).

    Examples
    --------
    >>> from nvalchemi_ase import NVAlchemiCalculator
    >>> calc = NVAlchemiCalculator(sevennet_0(), device="cpu")  # doctest: +SKIP
    """
    network = _build_network()
    return _wrapper_class()(network)


def __getattr__(name: str) -> Any:
    """Give ``SevenNetWrapper`` on first access (it subclasses an nvalchemi class).

    Parameters
    ----------
    name : str
        Attribute name.

    Returns
    -------
    type
        The ``SevenNetWrapper`` class.

    Raises
    ------
    AttributeError
        For any other name.
    """
    if name == "SevenNetWrapper":
        return _wrapper_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- loading --------------------------------------------------------------------


def _import_sevenn(module_name: str) -> Any:
    """Import a ``sevenn`` module silently, or explain which extra is missing."""
    try:
        with _quiet_sevenn():  # sevenn scripts modules at import time
            return import_quietly(module_name)
    except ImportError as exc:
        raise ImportError(
            f"SevenNet-0 needs the 'sevenn' package ({exc}); install it with "
            f"{SEVENNET_EXTRA}"
        ) from exc


def _checkpoint_path() -> str:
    """Path of the SevenNet-0 checkpoint inside the installed ``sevenn`` wheel."""
    constants = _import_sevenn("sevenn._const")
    path = str(constants.SEVENNET_0_11Jul2024)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the installed sevenn has no SevenNet-0 checkpoint at {path}; "
            f"reinstall it ({SEVENNET_EXTRA}); nvalchemi_ase never downloads weights"
        )
    return path


def _numpy_array_globals() -> list[Any]:
    """List the globals numpy arrays need, for ``torch.serialization.safe_globals``.

    A SevenNet checkpoint's config holds numpy arrays (per-species energy shifts
    and scales); pickles written with numpy 1.x name the array constructor
    ``numpy.core.multiarray._reconstruct``.
    """
    reconstruct = importlib.import_module("numpy._core.multiarray")._reconstruct
    dtype_classes = {type(np.dtype(code)) for code in "?bhilqBHILQefdgFDG"}
    return [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        *sorted(dtype_classes, key=lambda cls: cls.__name__),
    ]


def _check_checkpoint_is_data(path: str) -> Mapping[str, Any]:
    """Unpickle the checkpoint with ``weights_only=True`` (numpy arrays allowed).

    Proves the file holds only tensors, numpy arrays and plain containers
    before sevenn unpickles it without restrictions (see :func:`_build_network`).

    Returns
    -------
    Mapping
        The checkpoint's content (``config``, ``model_state_dict``, ...).
    """
    with torch.serialization.safe_globals(_numpy_array_globals()):
        content = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(content, Mapping) or "model_state_dict" not in content:
        raise ValueError(f"{path} is not a SevenNet checkpoint")
    return content


def _build_network() -> torch.nn.Module:
    """SevenNet-0's ``AtomGraphSequential`` in eval mode, weights frozen, on CPU."""
    checkpoint_module = _import_sevenn("sevenn.checkpoint")
    path = _checkpoint_path()
    content = _check_checkpoint_is_data(path)
    cutoff = float(content["config"]["cutoff"])
    if cutoff != SEVENNET_0_CUTOFF:
        raise ValueError(f"{path}: cutoff {cutoff} Å, expected {SEVENNET_0_CUTOFF}")
    # The weights need sevenn's migration from the checkpoint's format (sevenn
    # 0.9.1: old module layout and convolution weight order) to the installed
    # model code. ``SevenNetCheckpoint`` is the only entry point to it; it takes
    # a path and unpickles with ``weights_only=False`` itself. The file is the
    # one shipped in the wheel (never a name that could trigger a download) and
    # was just shown to unpickle under ``weights_only=True``.
    with _quiet_sevenn():
        network = checkpoint_module.SevenNetCheckpoint(path).build_model()
    network.set_is_batch_data(True)
    network.eval()
    for parameter in network.parameters():
        parameter.requires_grad_(False)
    return network


@contextlib.contextmanager
def _quiet_sevenn() -> Iterator[None]:
    """Keep sevenn's prints off stdout and torch's jit notice off stderr.

    sevenn builds its model with ``torch.jit.script``, which torch 2.14 answers
    with a FutureWarning the user cannot act on.
    """
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.jit\.script.*", category=FutureWarning
        )
        yield


# -- the wrapper ------------------------------------------------------------------


@dataclass
class _Graph:
    """One batch as SevenNet's layers see it (all tensors in the model dtype).

    Attributes
    ----------
    species : torch.Tensor
        [V] int64 index of each atom's element in SevenNet's type map.
    batch_idx : torch.Tensor
        [V] int64 structure of each atom.
    num_graphs : int
        B, the number of structures.
    edge_index : torch.Tensor
        [2, E] int64 (centre i, neighbour j), edges within the cutoff only.
    edge_graph : torch.Tensor
        [E] int64 structure of each edge.
    edge_vectors : torch.Tensor
        [E, 3] ``x_j - x_i + S_ij · cell``, Å.
    cell : torch.Tensor or None
        [B, 3, 3] cell (rows are lattice vectors), Å.
    """

    species: torch.Tensor
    batch_idx: torch.Tensor
    num_graphs: int
    edge_index: torch.Tensor
    edge_graph: torch.Tensor
    edge_vectors: torch.Tensor
    cell: torch.Tensor | None


class _SevenNetModule(torch.nn.Module):
    """SevenNet's network evaluated on a whole nvalchemi ``Batch`` (torch only).

    :func:`_wrapper_class` combines it with nvalchemi's ``BaseModelMixin``.

    Parameters
    ----------
    network : torch.nn.Module
        sevenn's ``AtomGraphSequential`` (``cutoff`` and ``type_map`` set).
    """

    model_config: Any
    species_of_number: torch.Tensor
    supported_elements: frozenset[int]

    def __init__(self, network: Any) -> None:
        super().__init__()
        base = import_quietly("nvalchemi.models.base")
        self.network = network
        self.cutoff = float(network.cutoff)
        self._layer_names = [name for name in network._modules if name not in _REPLACED]
        self._convolutions = {
            name
            for name, layer in network.named_children()
            if type(layer).__name__ == "IrrepsConvolution"
            and not getattr(layer, "is_parallel", False)
        }
        for name in self._convolutions:
            _merge_column_slices(network._modules[name].convolution)
        missing = _REPLACED - set(network._modules)
        if missing:
            raise ValueError(f"unexpected SevenNet layout: no {sorted(missing)}")
        self.num_species = len(network.type_map)
        table = torch.full((_MAX_ATOMIC_NUMBER + 1,), -1, dtype=torch.long)
        for number, index in network.type_map.items():
            table[int(number)] = int(index)
        self.register_buffer("species_of_number", table, persistent=False)
        #: Atomic numbers the checkpoint was trained on (its config's type map;
        #: read by :func:`nvalchemi_ase.models.supported_elements`).
        self.supported_elements = frozenset(int(z) for z in network.type_map)
        self.model_config = base.ModelConfig(
            outputs=frozenset({"energy", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            supports_pbc=True,
            neighbor_config=base.NeighborConfig(
                cutoff=self.cutoff, format=base.NeighborListFormat.COO
            ),
            active_outputs={"energy", "forces"},
        )

    # -- nvalchemi's abstract interface ------------------------------------------

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        """Embeddings this wrapper publishes: none.

        Returns
        -------
        dict
            Empty.
        """
        return {}

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        """Not available for SevenNet-0 in this wrapper.

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
        raise NotImplementedError("the SevenNet-0 wrapper publishes no embeddings")

    # -- forward -----------------------------------------------------------------

    def forward(self, data: Batch, **kwargs: Any) -> OrderedDict[str, Any]:
        """Energy, forces and (when active) stress of every structure in a batch.

        Parameters
        ----------
        data : nvalchemi.data.Batch
            B structures with ``positions`` [V, 3] Å, ``atomic_numbers`` [V],
            ``batch_idx`` [V], a COO neighbour list (``neighbor_list`` [E, 2],
            ``neighbor_list_shifts`` [E, 3] integer cell images) built with a
            cutoff of at least 5 Å, and ``cell`` [B, 3, 3] Å when any structure
            is periodic or stress is wanted.
        **kwargs
            Ignored (nvalchemi interface).

        Returns
        -------
        OrderedDict
            Keys of ``model_config.active_outputs`` (sorted): ``energy`` [B, 1]
            eV, ``forces`` [V, 3] eV/Å, ``stress`` [B, 3, 3] eV/Å³
            (tensile-positive Cauchy stress, ASE's sign; for structures without
            three lattice vectors it uses the batch's stand-in cell and is not
            physical). Dtype of ``positions``.

        Raises
        ------
        ValueError
            For an element SevenNet-0 was not trained on, or stress without a
            cell.
        """
        active = set(self.model_config.active_outputs) & set(self.model_config.outputs)
        want_forces, want_stress = "forces" in active, "stress" in active
        out_dtype = data.positions.dtype
        keep_graph = self.training or bool(data.positions.requires_grad)
        need_gradient = want_forces or want_stress
        with torch.set_grad_enabled(need_gradient or torch.is_grad_enabled()):
            graph = self._graph(data, need_cell=want_stress)
            if need_gradient:
                graph.edge_vectors.requires_grad_(True)
            energy = self._energy(graph)
            results: dict[str, torch.Tensor] = {"energy": energy.unsqueeze(-1)}
            if need_gradient:
                edge_gradient = _edge_gradient(
                    energy, graph.edge_vectors, keep_graph=keep_graph
                )
                if want_forces:
                    results["forces"] = _forces(graph, edge_gradient, data)
                if want_stress:
                    results["stress"] = _stress(graph, edge_gradient)
        return OrderedDict(
            (key, results[key].to(out_dtype) if key in results else None)
            for key in sorted(active)
        )

    def _graph(self, data: Batch, *, need_cell: bool) -> _Graph:
        dtype = self._dtype()
        positions = data.positions.to(dtype)
        cell = _field(data, "cell")
        cell = None if cell is None else cell.to(dtype)
        if need_cell and cell is None:
            raise ValueError("SevenNet-0 stress needs a cell; the batch has none")
        batch_idx = data.batch_idx.long()
        centre, neighbour, shifts = self._pairs(data, positions.shape[0])
        edge_graph = batch_idx[centre]
        offsets = None  # S_ij · cell, Å
        if shifts is not None and cell is not None:
            offsets = torch.einsum("ea,eab->eb", shifts.to(dtype), cell[edge_graph])
        inside = _within(positions, centre, neighbour, offsets, self.cutoff)
        centre, neighbour, edge_graph = (
            centre[inside],
            neighbour[inside],
            edge_graph[inside],
        )
        vectors = positions[neighbour] - positions[centre]
        if offsets is not None:
            vectors = vectors + offsets[inside]
        return _Graph(
            species=self._species(data.atomic_numbers),
            batch_idx=batch_idx,
            num_graphs=int(data.num_graphs),
            edge_index=torch.stack((centre, neighbour)),
            edge_graph=edge_graph,
            edge_vectors=vectors,
            cell=cell,
        )

    def _pairs(
        self, data: Batch, num_atoms: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Centre and neighbour indices [E] and cell shifts [E, 3] of the list."""
        pairs = _field(data, "neighbor_list")
        if pairs is None:
            raise ValueError(
                "SevenNet-0 needs a COO neighbour list on the batch: call "
                "nvalchemi.neighbors.compute_neighbors(batch, "
                "config=model.model_config.neighbor_config) first"
            )
        built = getattr(data, "_neighbor_list_cutoff", None)
        if built is not None and float(built) < self.cutoff - 1e-6:
            raise ValueError(
                f"the neighbour list was built to {built} Å; SevenNet-0 needs "
                f"at least {self.cutoff} Å"
            )
        pairs = pairs.long()
        centre, neighbour = pairs[:, 0], pairs[:, 1]
        valid = (centre < num_atoms) & (neighbour < num_atoms)  # drop padding
        shifts = _field(data, "neighbor_list_shifts")
        return (
            centre[valid],
            neighbour[valid],
            None if shifts is None else shifts[valid],
        )

    def _species(self, atomic_numbers: torch.Tensor) -> torch.Tensor:
        numbers = atomic_numbers.long()
        species = self.species_of_number[numbers.clamp(0, _MAX_ATOMIC_NUMBER)]
        unknown = (species < 0) | (numbers < 0) | (numbers > _MAX_ATOMIC_NUMBER)
        if bool(unknown.any()):
            bad = sorted({int(z) for z in numbers[unknown].tolist()})
            raise ValueError(
                f"SevenNet-0 was not trained on atomic number(s) {bad}; it knows "
                f"{self.num_species} elements"
            )
        return species

    def _energy(self, graph: _Graph) -> torch.Tensor:
        """Per-structure energy [B], eV, from SevenNet's per-atom energies."""
        dtype = self._dtype()
        one_hot = torch.nn.functional.one_hot(graph.species, self.num_species)
        features = one_hot.to(dtype)
        state: dict[str, torch.Tensor] = {
            "x": features,
            "node_attr": features,
            "atom_type": graph.species,
            "batch": graph.batch_idx,
            "edge_index": graph.edge_index,
            "edge_vec": graph.edge_vectors,
        }
        for name in self._layer_names:
            layer = getattr(self.network, name)
            if name in self._convolutions:
                state = _tiled_convolution(layer, state, CONVOLUTION_TILE_BYTES)
            else:
                state = layer(state)
        atomic = state[_ATOMIC_ENERGY_KEY].reshape(-1)
        energy = torch.zeros(graph.num_graphs, dtype=atomic.dtype, device=atomic.device)
        return energy.index_add(0, graph.batch_idx, atomic)

    def _dtype(self) -> torch.dtype:
        dtype = next(self.network.parameters()).dtype
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"SevenNet-0 runs in float32 or float64, not {dtype}")
        return dtype


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


def _tiled_convolution(
    layer: Any, state: dict[str, torch.Tensor], tile_bytes: int
) -> dict[str, torch.Tensor]:
    """Run one of sevenn's ``IrrepsConvolution`` layers over edges in tiles.

    The same sums as the layer's own forward (messages from neighbours j, summed
    on centres i, divided by the layer's denominator), built from its own
    ``weight_nn`` and ``convolution`` sub-modules, a tile of edges at a time.

    Parameters
    ----------
    layer : sevenn.nn.convolution.IrrepsConvolution
        The layer (its data keys name the state entries used).
    state : dict of str to torch.Tensor
        SevenNet's data dict: node features [V, F_in], edge filters [E, 9],
        radial embeddings [E, 8] and ``edge_index`` [2, E] (centre, neighbour).
    tile_bytes : int
        Size of one tile of messages, bytes (at least 64 edges per tile).

    Returns
    -------
    dict of str to torch.Tensor
        ``state`` with node features replaced by the layer's output [V, F_out].
    """
    features = state[layer.key_x]
    filters = state[layer.key_filter]
    radial = state[layer.key_weight_input]
    centre, neighbour = state[layer.key_edge_idx]
    width = layer.convolution.irreps_out.dim
    gathered = torch.zeros(
        (features.shape[0], width), dtype=features.dtype, device=features.device
    )
    tile = max(64, tile_bytes // (width * features.element_size()))
    for start in range(0, centre.shape[0], tile):
        edges = slice(start, start + tile)
        weight = layer.weight_nn(radial[edges])
        message = layer.convolution(features[neighbour[edges]], filters[edges], weight)
        gathered = gathered.index_add(0, centre[edges], message)
    state[layer.key_x] = gathered.div(layer.denominator)
    return state


def _merge_column_slices(tensor_product: torch.nn.Module) -> int:
    """Give e3nn's tensor product a cheap backward for its per-path slices.

    e3nn's generated code cuts its flattened inputs (node features, edge
    filters, per-edge path weights) into column blocks with ``x[:, a:b]``, one
    per irrep or path. Autograd turns each cut into a zero-filled gradient of
    the whole input, then adds them up: for the 960 path weights of a SevenNet
    layer that was a quarter of the model's CPU time. The cuts of one input are
    replaced here by a single ``torch.split`` (whose backward is one
    concatenation); the forward values are unchanged. A module whose code does
    not have this shape is left alone.

    Parameters
    ----------
    tensor_product : torch.nn.Module
        An ``e3nn.o3.TensorProduct``; its ``_compiled_main_left_right``
        ``torch.fx.GraphModule`` is rewritten in place.

    Returns
    -------
    int
        Number of slices replaced (0 when nothing matched).
    """
    module = getattr(tensor_product, "_compiled_main_left_right", None)
    if not isinstance(module, torch.fx.GraphModule):
        return 0
    graph = module.graph
    replaced = 0
    for source, cuts in _column_cuts(graph).items():
        if len(cuts) < 2 or not _disjoint(cuts):
            continue
        bounds = sorted(
            {0} | {bound for start, stop, _ in cuts for bound in (start, stop)}
        )
        with graph.inserting_after(source):
            pieces = graph.call_function(_split_columns, (source, tuple(bounds[1:])))
        for start, _, node in cuts:
            with graph.inserting_after(pieces):
                piece = graph.call_function(
                    operator.getitem, (pieces, bounds.index(start))
                )
            node.replace_all_uses_with(piece)
            graph.erase_node(node)
            replaced += 1
    if replaced:
        graph.lint()
        module.recompile()
    return replaced


def _column_cuts(graph: torch.fx.Graph) -> dict[Any, list[tuple[int, int, Any]]]:
    """``x[:, a:b]`` nodes of a graph, as ``{x: [(a, b, node), ...]}``."""
    cuts: dict[Any, list[tuple[int, int, Any]]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        source, index = node.args
        if not (
            isinstance(source, torch.fx.Node)
            and isinstance(index, tuple)
            and len(index) == 2
            and index[0] == slice(None)
            and isinstance(index[1], slice)
            and index[1].step is None
            and isinstance(index[1].start, int)
            and isinstance(index[1].stop, int)
        ):
            continue
        cuts.setdefault(source, []).append((index[1].start, index[1].stop, node))
    return cuts


def _disjoint(cuts: list[tuple[int, int, Any]]) -> bool:
    """Whether column ranges ``(a, b, node)`` are non-empty and do not overlap."""
    ordered = sorted(cuts, key=lambda cut: cut[0])
    non_empty = all(start < stop for start, stop, _ in ordered)
    return non_empty and all(
        later[0] >= earlier[1] for earlier, later in itertools.pairwise(ordered)
    )


def _split_columns(
    tensor: torch.Tensor, bounds: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` [N, C] into columns ``[0, b0), [b0, b1), ..., [bk, C)``."""
    edges = (0, *bounds, tensor.shape[1])
    sizes = [stop - start for start, stop in itertools.pairwise(edges)]
    return torch.split(tensor, sizes, dim=1)


def _field(data: Batch, key: str) -> torch.Tensor | None:
    """``data.<key>``, or None when the batch has no such field."""
    value = getattr(data, key, None)
    return value if isinstance(value, torch.Tensor) else None


def _edge_gradient(
    energy: torch.Tensor, edge_vectors: torch.Tensor, *, keep_graph: bool
) -> torch.Tensor:
    """∂E/∂r_ij [E, 3] (zero when a structure has no edges)."""
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


def _forces(graph: _Graph, edge_gradient: torch.Tensor, data: Batch) -> torch.Tensor:
    """F_i = -∂E/∂x_i [V, 3], eV/Å, from r_ij = x_j - x_i + shift."""
    centre, neighbour = graph.edge_index
    forces = torch.zeros(
        (data.positions.shape[0], 3),
        dtype=edge_gradient.dtype,
        device=edge_gradient.device,
    )
    forces = forces.index_add(0, centre, edge_gradient)
    return forces.index_add(0, neighbour, edge_gradient, alpha=-1)


def _stress(graph: _Graph, edge_gradient: torch.Tensor) -> torch.Tensor:
    """σ = (1/V) Σ sym(∂E/∂r ⊗ r) [B, 3, 3], eV/Å³, tensile positive."""
    assert graph.cell is not None  # checked in _graph  # noqa: S101
    per_edge = edge_gradient.unsqueeze(2) * graph.edge_vectors.unsqueeze(1)
    virial = torch.zeros(
        (graph.num_graphs, 3, 3), dtype=per_edge.dtype, device=per_edge.device
    )
    virial = virial.index_add(0, graph.edge_graph, per_edge)
    volume = torch.linalg.det(graph.cell).abs().reshape(-1, 1, 1)
    return 0.5 * (virial + virial.mT) / volume


_WRAPPER_DOC = """SevenNet-0 as an nvalchemi model: a ``Batch`` in one forward pass.

Built by :func:`sevennet_0`; see that function and the module docstring for the
outputs, units and conventions. ``model.network`` is sevenn's
``AtomGraphSequential`` (eval mode, frozen weights); its one-hot embedding,
energy reduction and force/stress output are replaced by the wrapper's own.

Parameters
----------
network : torch.nn.Module
    sevenn's ``AtomGraphSequential`` for SevenNet-0.
"""


@functools.cache
def _wrapper_class() -> type:
    """``SevenNetWrapper``: :class:`_SevenNetModule` plus ``BaseModelMixin``."""
    base = import_quietly("nvalchemi.models.base")
    return type(
        "SevenNetWrapper",
        (_SevenNetModule, base.BaseModelMixin),
        {
            "__module__": __name__,
            "__qualname__": "SevenNetWrapper",
            "__doc__": _WRAPPER_DOC,
        },
    )
