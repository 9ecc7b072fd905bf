"""The model's forces and stress as evaluated, before the constraints adjust them.

The constraint hooks (nvalchemi's ``FreezeAtomsHook`` for ``FixAtoms``,
:mod:`.constraints` for the others) adjust ``batch.forces`` (and, for
``FixSymmetry``, ``batch.stress``) in place at ``AFTER_COMPUTE``, because the
engines step with the adjusted values. ASE keeps the calculator's raw values:
``atoms.calc.results``, ``atoms.get_forces(apply_constraint=False)`` and
trajectory frames hold them, and ``atoms.get_forces()`` applies the constraints
on reading. :class:`RawResults` copies the raw values at ``AFTER_COMPUTE``,
before any constraint hook, so the write-back can report them. It copies only
while a force-changing constraint exists: unconstrained runs pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi_ase.convert import batch_field

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["RawResults", "SaveHook"]


class RawResults:
    """Copies of ``batch.forces`` [V, 3] eV/Å (and ``stress`` [B, 3, 3] eV/Å³).

    Register :meth:`hook` after the failure guard's hooks and before every
    constraint hook; :meth:`configure` says whether (and what) to copy.

    Parameters
    ----------
    put_back : callable, optional
        Returns the [B] bool mask of the structures the failure guard put
        back to their last good state at this evaluation
        (:meth:`~nvalchemi_ase.dynamics.failures.FailureGuard.put_back`);
        their copies are not replaced (the raw values of that state are the
        copies already held). A structure rejected at an evaluation that
        follows no step is not put back: its rows hold the model's outputs
        for the state it was given, and are copied.
    """

    def __init__(self, put_back: Callable[[], torch.Tensor] | None = None) -> None:
        self._put_back = put_back
        self._keys: tuple[str, ...] = ()
        self._saved: dict[str, torch.Tensor] = {}
        self._carried: dict[str, torch.Tensor] = {}

    def configure(self, *, forces: bool, stress: bool) -> None:
        """Choose what to copy from the next evaluation on; forget older copies.

        Parameters
        ----------
        forces : bool
            Some constraint changes forces (``FixAtoms``, ``FixCartesian``,
            ``FixCom``, ``FixSymmetry``, the RATTLE constraints).
        stress : bool
            Some constraint changes the stress (``FixSymmetry``).
        """
        self._keys = (("forces",) if forces else ()) + (("stress",) if stress else ())
        self._saved = {}

    def hook(self, stages: Any) -> SaveHook:
        """Return the ``AFTER_COMPUTE`` hook taking the copies (``DynamicsStage``)."""
        return SaveHook(stages.AFTER_COMPUTE, self)

    def save(self, batch: Batch, active: torch.Tensor | None = None) -> None:
        """Copy the model's fresh outputs (no-op without force-changing constraints).

        Parameters
        ----------
        batch : nvalchemi.data.Batch
            The batch right after the model's evaluation.
        active : torch.Tensor, optional
            [B] bool, the graphs the model evaluated (the dispatch's
            ``active_graph_mask``); the others keep their earlier copies, as
            their batch rows hold already adjusted values. None: every graph.
        """
        if self._put_back is not None and self._keys:
            restored = self._put_back()
            if restored.shape[0] == batch.num_graphs:
                active = ~restored if active is None else active & ~restored
        for key in self._keys:
            value = batch_field(batch, key)
            if value is None:
                self._saved.pop(key, None)
                continue
            value = value.detach()
            saved = self._saved.get(key)
            with torch.no_grad():
                if saved is None or saved.shape != value.shape:
                    self._saved[key] = value.clone()
                elif active is None:
                    saved.copy_(value)
                else:
                    rows = active if key == "stress" else active[batch.batch_idx.long()]
                    rows = rows.view(-1, *([1] * (value.dim() - 1)))
                    torch.where(rows, value, saved, out=saved)
                carried = self._carried.get(key)
                if carried is not None:
                    self._saved[key][: carried.shape[0]] = carried
        self._carried = {}

    def select(
        self, batch: Batch, atoms: torch.Tensor, graphs: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Return the copies' rows of some structures (those a resize keeps).

        Parameters
        ----------
        batch : nvalchemi.data.Batch
            The batch the copies were taken from.
        atoms, graphs : torch.Tensor
            Their atom rows and graph indices (long).
        """
        return {
            key: saved.index_select(0, graphs if key == "stress" else atoms)
            for key, saved in self.outputs(batch).items()
        }

    def carry(self, leading: dict[str, torch.Tensor]) -> None:
        """Put ``leading`` into the first rows at the next :meth:`save`.

        After a resize the kept structures lead the batch and the model
        evaluates only the admitted ones; the kept ones' batch rows hold
        adjusted values, so their raw copies (from :meth:`select`) come along.
        An empty mapping cancels it (the kept structures moved since).
        """
        self._carried = dict(leading)

    def outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Return the raw values to report for ``batch`` (empty: the batch's own).

        A copy whose shape no longer matches the batch's field (the batch was
        resized since) is not reported.
        """
        reported = {}
        for key, saved in self._saved.items():
            value = batch_field(batch, key)
            if value is not None and value.shape == saved.shape:
                reported[key] = saved
        return reported


class SaveHook:
    """An nvalchemi hook: :meth:`RawResults.save` with the dispatch's active graphs."""

    frequency = 1

    def __init__(self, stage: Any, raw: RawResults) -> None:
        self.stage = stage
        self._raw = raw

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Copy the outputs of the graphs this dispatch evaluated."""
        self._raw.save(ctx.batch, getattr(ctx, "active_graph_mask", None))
