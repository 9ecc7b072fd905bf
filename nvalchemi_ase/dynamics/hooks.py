"""A batch-level nvalchemi hook: one function at one stage.

The package's own hooks (failure guard, constraints, cell-filter options)
each act on the whole batch at one ``DynamicsStage``; this is their common
shape, nvalchemi's ``Hook`` protocol (``stage``, ``frequency``,
``__call__(ctx, stage)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nvalchemi.data import Batch

__all__ = ["StageHook"]


class StageHook:
    """An nvalchemi hook calling ``action(batch)`` at ``stage``, every step.

    Parameters
    ----------
    stage : nvalchemi.dynamics.base.DynamicsStage
        When it runs.
    action : callable
        ``action(batch)``, acting on the batch in place.
    """

    frequency = 1

    def __init__(self, stage: Any, action: Callable[[Batch], None]) -> None:
        self.stage = stage
        self._action = action

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Run the action on the hook context's batch."""
        self._action(ctx.batch)
