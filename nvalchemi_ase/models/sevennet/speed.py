"""Speed surgery on sevenn's layers, for a batched pass at least as fast as sevenn's.

On the CPU SevenNet's cost is linear in the number of edges, and two things
made a whole batch slower per edge than sevenn's one-structure calculator:

* **Whole-batch temporaries.** SevenNet's messages are up to 3136 numbers wide
  per edge; for a batch at once they reach hundreds of MB, which the C
  allocator serves with fresh zeroed pages on every call (half of the time went
  to page faults in a 784-atom batch). :func:`tiled_convolution` runs each
  convolution over edges in tiles of :data:`CONVOLUTION_TILE_BYTES`, below
  glibc's 32 MB mmap threshold, so memory is reused between tiles and calls.
* **e3nn's per-path column slices.** Autograd turns each ``x[:, a:b]`` into a
  zero-filled gradient of the whole input; :func:`merge_column_slices`
  rewrites them into one ``torch.split`` (backward: one concatenation).

Both leave the values unchanged (tested to 0 in float64). Checked against
sevenn 0.13.0 (``sevenn.nn.convolution.IrrepsConvolution``: ``weight_nn``,
``convolution``, ``key_x``, ``key_filter``, ``key_weight_input``,
``key_edge_idx``, ``denominator``) and e3nn 0.6.0 (``TensorProduct``'s
``_compiled_main_left_right`` ``torch.fx.GraphModule``); a layout that does
not match is left alone (:func:`merge_column_slices` returns 0).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

__all__ = [
    "CONVOLUTION_TILE_BYTES",
    "merge_column_slices",
    "split_columns",
    "tiled_convolution",
]

#: Size of one tile of per-edge messages in the convolutions, bytes: every
#: temporary stays below glibc's 32 MB mmap threshold.
CONVOLUTION_TILE_BYTES = 16 * 2**20


def tiled_convolution(
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


def merge_column_slices(tensor_product: torch.nn.Module) -> int:
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
            pieces = graph.call_function(split_columns, (source, tuple(bounds[1:])))
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


def split_columns(
    tensor: torch.Tensor, bounds: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` [N, C] into columns ``[0, b0), [b0, b1), ..., [bk, C)``."""
    edges = (0, *bounds, tensor.shape[1])
    sizes = [stop - start for start, stop in itertools.pairwise(edges)]
    return torch.split(tensor, sizes, dim=1)
