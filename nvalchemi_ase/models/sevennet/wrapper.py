"""SevenNet's network evaluated on a whole nvalchemi ``Batch`` in one pass.

The graph comes from nvalchemi's COO neighbour list and forces and stress from
the edge-vector gradient (:mod:`nvalchemi_ase.models.edge_vectors`); SevenNet's
layers run unchanged except three that the wrapper replaces: the one-hot
embedding (sevenn hard-codes float32 with ``.float()``), the energy reduction
(sevenn sizes its output from ``batch.max()``) and the force output (computed
here, with stress only on demand and in ASE's sign). Its convolutions run in
tiles (:mod:`nvalchemi_ase.models.sevennet.speed`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.convert import MAX_ATOMIC_NUMBER as _MAX_ATOMIC_NUMBER
from nvalchemi_ase.models.edge_vectors import (
    EdgeGraph,
    EdgeVectorModule,
    edge_vector_outputs,
)
from nvalchemi_ase.models.sevennet.speed import (
    CONVOLUTION_TILE_BYTES,
    merge_column_slices,
    tiled_convolution,
)

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["wrapper_class"]

# Module names of sevenn's ``AtomGraphSequential`` that this wrapper replaces.
_ONE_HOT = "onehot_idx_to_onehot"
_REPLACED = frozenset({_ONE_HOT, "reduce_total_enegy", "force_output"})
_ATOMIC_ENERGY_KEY = "atomic_energy"


class _SevenNetModule(EdgeVectorModule):
    """SevenNet's network evaluated on a whole nvalchemi ``Batch`` (torch only).

    :func:`wrapper_class` combines it with nvalchemi's ``BaseModelMixin``.

    Parameters
    ----------
    network : torch.nn.Module
        sevenn's ``AtomGraphSequential`` (``cutoff`` and ``type_map`` set).
    modal : str or None
        The fidelity of a multi-fidelity checkpoint (a key of its
        ``modal_map``, any case, e.g. ``"pbe"`` for SevenNet-MF-0); must be
        None for a single-fidelity one.
    label : str
        The model's name in messages.
    """

    model_config: Any
    species_of_number: torch.Tensor
    supported_elements: frozenset[int]
    #: Index of the chosen fidelity in the checkpoint's modal map, or None.
    modal_index: int | None
    #: The chosen fidelity's name as the checkpoint spells it, or None.
    modal: str | None

    def __init__(
        self, network: Any, modal: str | None = None, label: str = "SevenNet-0"
    ) -> None:
        super().__init__()
        self.network = network
        self.label = label
        self.modal, self.modal_index = _modal_choice(network, modal, label)
        self.cutoff = float(network.cutoff)
        self._layer_names = [name for name in network._modules if name not in _REPLACED]
        self._convolutions = {
            name
            for name, layer in network.named_children()
            if type(layer).__name__ == "IrrepsConvolution"
            and not getattr(layer, "is_parallel", False)
        }
        for name in self._convolutions:
            merge_column_slices(network._modules[name].convolution)
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
        self.configure_edge_outputs(self.cutoff)

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
            For an element the checkpoint was not trained on, or stress without a
            cell.
        """
        active = set(self.model_config.active_outputs) & set(self.model_config.outputs)
        results = edge_vector_outputs(
            data,
            functools.partial(self._energy, self._species(data.atomic_numbers)),
            cutoff=self.cutoff,
            dtype=self._dtype(),
            want_forces="forces" in active,
            want_stress="stress" in active,
            keep_graph=self.training or bool(data.positions.requires_grad),
            model_name=self.label,
        )
        out_dtype = data.positions.dtype
        return OrderedDict(
            (key, results[key].to(out_dtype) if key in results else None)
            for key in sorted(active)
        )

    def _species(self, atomic_numbers: torch.Tensor) -> torch.Tensor:
        numbers = atomic_numbers.long()
        species = self.species_of_number[numbers.clamp(0, _MAX_ATOMIC_NUMBER)]
        unknown = (species < 0) | (numbers < 0) | (numbers > _MAX_ATOMIC_NUMBER)
        if bool(unknown.any()):
            bad = sorted({int(z) for z in numbers[unknown].tolist()})
            raise ValueError(
                f"{self.label} was not trained on atomic number(s) {bad}; it knows "
                f"{self.num_species} elements"
            )
        return species

    def _energy(self, species: torch.Tensor, graph: EdgeGraph) -> torch.Tensor:
        """Per-structure energy [B], eV, from SevenNet's per-atom energies.

        ``species`` [V] is each atom's index in SevenNet's type map.
        """
        dtype = self._dtype()
        one_hot = torch.nn.functional.one_hot(species, self.num_species)
        features = one_hot.to(dtype)
        state: dict[str, torch.Tensor] = {
            "x": features,
            "node_attr": features,
            "atom_type": species,
            "batch": graph.batch_idx,
            "edge_index": graph.edge_index,
            "edge_vec": graph.edge_vectors,
        }
        if self.modal_index is not None:
            # one fidelity index per structure (sevenn's batched layout)
            state["modal_type"] = torch.full(
                (graph.num_graphs,),
                self.modal_index,
                dtype=torch.long,
                device=species.device,
            )
        for name in self._layer_names:
            layer = getattr(self.network, name)
            if name in self._convolutions:
                state = tiled_convolution(layer, state, CONVOLUTION_TILE_BYTES)
            else:
                state = layer(state)
        atomic = state[_ATOMIC_ENERGY_KEY].reshape(-1)
        energy = torch.zeros(graph.num_graphs, dtype=atomic.dtype, device=atomic.device)
        return energy.index_add(0, graph.batch_idx, atomic)

    def _dtype(self) -> torch.dtype:
        dtype = next(self.network.parameters()).dtype
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{self.label} runs in float32 or float64, not {dtype}")
        return dtype


_WRAPPER_DOC = """A SevenNet checkpoint as an nvalchemi model: a ``Batch`` in one pass.

Built by :func:`sevennet_0` and its siblings; see that function and the
module docstring for the outputs, units and conventions. ``model.network`` is sevenn's
``AtomGraphSequential`` (eval mode, frozen weights); its one-hot embedding,
energy reduction and force/stress output are replaced by the wrapper's own.

Parameters
----------
network : torch.nn.Module
    sevenn's ``AtomGraphSequential`` of a checkpoint.
modal : str or None
    Fidelity of a multi-fidelity checkpoint (``"pbe"``, ``"r2scan"`` for
    SevenNet-MF-0); None for the others.
label : str
    The model's name in messages.
"""


def _modal_choice(
    network: Any, modal: str | None, label: str
) -> tuple[str | None, int | None]:
    """Return the checkpoint's spelling and index of fidelity ``modal`` (any case)."""
    modal_map = dict(getattr(network, "modal_map", None) or {})
    if not modal_map:
        if modal is not None:
            raise ValueError(f"{label} has one fidelity; modal={modal!r} is not taken")
        return None, None
    known = sorted(name.lower() for name in modal_map)
    if modal is None:
        raise ValueError(f"{label} is multi-fidelity: choose modal= one of {known}")
    if not isinstance(modal, str):
        raise TypeError(f"{label}: modal must be a str, got {type(modal).__name__}")
    matches = [name for name in modal_map if name.lower() == modal.lower()]
    if not matches:
        raise ValueError(f"{label}: unknown modal {modal!r}; choose one of {known}")
    return matches[0], int(modal_map[matches[0]])


@functools.cache
def wrapper_class() -> type:
    """``SevenNetWrapper``: :class:`_SevenNetModule` plus ``BaseModelMixin``."""
    base = import_quietly("nvalchemi.models.base")
    return type(
        "SevenNetWrapper",
        (_SevenNetModule, base.BaseModelMixin),
        {
            "__module__": "nvalchemi_ase.models.sevennet",
            "__qualname__": "SevenNetWrapper",
            "__doc__": _WRAPPER_DOC,
        },
    )
