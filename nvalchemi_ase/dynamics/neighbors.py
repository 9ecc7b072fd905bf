"""Neighbour lists for the dynamics engines: nvalchemi's hook, eager and skin-aware.

The hook is nvalchemi's ``NeighborListHook`` run without ``torch.compile``, and
skipped outright while its Verlet skin still holds.

nvalchemi's ``NeighborListHook`` keeps a list built to ``cutoff + skin`` and, per
system, rebuilds only where an atom moved more than ``skin / 2``. Even when no
system needs it, every call still re-stages the inputs, launches the list kernel,
re-marks stale entries and rewrites the batch's neighbour fields (a COO list is
re-converted from the matrix): about a quarter of an LJ step on a CPU. The hook
here answers "nothing moved enough" first and then does nothing, and otherwise
runs nvalchemi's own call unchanged. The check reads one number back to the host,
which is free on a CPU; on an accelerator it would be a synchronisation per step,
so there nvalchemi's own (sync-free) path always runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase._compat import (
    eager_call,
    load_neighbor_hook_state,
    neighbor_hook_capacity,
    neighbor_hook_reference,
    neighbor_hook_state,
    reserve_neighbor_capacity,
)
from nvalchemi_ase._quiet import import_quietly

if TYPE_CHECKING:
    from nvalchemi.data import Batch
    from nvalchemi.models.base import BaseModelMixin

__all__ = [
    "carry_neighbor_capacity",
    "is_neighbor_hook",
    "load_neighbor_state",
    "neighbor_hooks",
    "neighbor_state",
]


def neighbor_hooks(model: BaseModelMixin, skin: float) -> list[Any]:
    """Neighbour-list hooks for ``model`` with a Verlet skin.

    nvalchemi's ``NeighborListHook.__call__`` is wrapped in ``torch.compile``;
    on the CPU that costs about a second of compilation per new batch shape
    and buys nothing (step times are the same with ``TORCHDYNAMO_DISABLE=1``),
    so the hook's own, uncompiled function is used, behind the skip
    described in the module docstring.

    Parameters
    ----------
    model : BaseModelMixin
        The model whose ``NeighborConfig`` (cutoff, format, half list) is used.
    skin : float
        Verlet skin, Å: the list is built to ``cutoff + skin`` and rebuilt only
        when an atom moved more than ``skin / 2`` since the last build.

    Returns
    -------
    list
        One ``NeighborListHook`` at ``BEFORE_COMPUTE``, or none when the model
        needs no neighbour list. Its ``builds`` attribute counts the calls that
        reached nvalchemi's list code.
    """
    config = model.model_config.neighbor_config
    if config is None:
        return []
    stages = import_quietly("nvalchemi.dynamics.base").DynamicsStage
    return [_skipping_hook_class()(config, skin=skin, stage=stages.BEFORE_COMPUTE)]


def is_neighbor_hook(hook: object) -> bool:
    """Whether ``hook`` is a neighbour-list hook made by :func:`neighbor_hooks`."""
    return isinstance(hook, _skipping_hook_class())


@functools.cache
def _skipping_hook_class() -> type:
    base: Any = import_quietly("nvalchemi.hooks").NeighborListHook
    compiled_call = base.__call__
    eager = eager_call(compiled_call)

    class SkinNeighborListHook(base):  # type: ignore[misc,valid-type]
        """nvalchemi's ``NeighborListHook``, eager, skipped while its skin holds."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.builds = 0
            self._written: torch.Tensor | None = None
            self._cell_at_build: torch.Tensor | None = None

        def __call__(self, ctx: Any, stage: Any) -> None:
            batch = ctx.batch
            if _list_still_holds(self, batch):
                return
            eager(self, ctx, stage)
            self.builds += 1
            self._written = _neighbor_data(batch)
            self._cell_at_build = _cell_of(batch)

    return SkinNeighborListHook


def carry_neighbor_capacity(old_hooks: list[Any], new_hooks: list[Any]) -> None:
    """Start the new engine's neighbour lists at the capacity the old ones found.

    A runner's refill builds a new engine over a batch much like the last
    one. Left alone, its first list build allocates nvalchemi's density
    estimate of the neighbour capacity K (about seven times what an argon
    crystal needs at an 8.5 Å LJ cutoff), fills and trims it: about a third of
    a refill's first evaluation for 4096 atoms on a CPU. Starting at the old
    list's K skips that; the list grows itself when an atom has more
    neighbours, and its contents (rows, their order) do not depend on K, so
    the forces are the same to the bit.

    Parameters
    ----------
    old_hooks, new_hooks : list
        The two engines' hooks; neighbour-list hooks are paired in order.
    """
    old = [hook for hook in old_hooks if is_neighbor_hook(hook)]
    new = [hook for hook in new_hooks if is_neighbor_hook(hook)]
    for previous, fresh in zip(old, new, strict=False):
        capacity = neighbor_hook_capacity(previous)
        if capacity is not None and neighbor_hook_capacity(fresh) is None:
            reserve_neighbor_capacity(fresh, capacity)


def neighbor_state(hook: Any) -> dict[str, torch.Tensor]:
    """Return the list ``hook`` holds, for a checkpoint (copies; empty if unbuilt).

    Parameters
    ----------
    hook : SkinNeighborListHook
        A hook made by :func:`neighbor_hooks`.

    Returns
    -------
    dict of torch.Tensor
        nvalchemi's list (``matrix`` [V, K], ``num_neighbors`` [V], ``shifts``
        [V, K, 3], ``reference_positions`` [V, 3] Å) and ``cell_at_build``
        [B, 3, 3] Å, the cells the skin test compares against.
    """
    state = neighbor_hook_state(hook)
    if state and hook._cell_at_build is not None:
        state["cell_at_build"] = hook._cell_at_build.clone()
    return state


def load_neighbor_state(
    hook: Any, state: dict[str, torch.Tensor], batch: Batch
) -> None:
    """Give ``hook`` (built once for ``batch``) the list of :func:`neighbor_state`.

    Parameters
    ----------
    hook : SkinNeighborListHook
        A hook that has built a list for ``batch`` (after the priming
        evaluation).
    state : dict of torch.Tensor
        What :func:`neighbor_state` returned in the run being continued.
    batch : Batch
        The batch; its neighbour fields are rewritten.
    """
    if not state:
        return
    load_neighbor_hook_state(hook, state, batch)
    hook._written = _neighbor_data(batch)
    cell = state.get("cell_at_build")
    hook._cell_at_build = None if cell is None else cell.to(batch.device)


def _list_still_holds(hook: Any, batch: Batch) -> bool:
    """Whether the last list is still exact for ``batch`` (CPU only, see above).

    True when the batch still carries the very tensors the hook wrote, has the
    same atoms and systems, the same cells, and no atom moved more than
    ``skin / 2`` since the list was built.
    """
    if batch.positions.device.type != "cpu" or hook.skin <= 0.0:
        return False
    reference, allocated_atoms, allocated_systems = neighbor_hook_reference(hook)
    if (
        reference is None
        or hook._written is None
        or allocated_atoms != batch.num_nodes
        or allocated_systems != batch.num_graphs
        or _neighbor_data(batch) is not hook._written
    ):
        return False
    cell = getattr(batch, "cell", None)  # compared, not copied: this runs every step
    if (cell is None) != (hook._cell_at_build is None) or (
        cell is not None and not torch.equal(cell, hook._cell_at_build)
    ):
        return False
    with torch.no_grad():
        moved = (batch.positions - reference).square().sum(dim=1).max()
    return bool(moved <= (0.5 * hook.skin) ** 2)


def _neighbor_data(batch: Batch) -> torch.Tensor | None:
    matrix = getattr(batch, "neighbor_matrix", None)
    return matrix if matrix is not None else getattr(batch, "neighbor_list", None)


def _cell_of(batch: Batch) -> torch.Tensor | None:
    cell = getattr(batch, "cell", None)
    return None if cell is None else cell.detach().clone()
