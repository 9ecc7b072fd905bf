"""One lock per model object: evaluations of a shared model never interleave.

A model object keeps state between the steps of one evaluation (nvalchemi's
``narrowed_outputs`` sets its active outputs for the block), and a
calculator keeps a reusable batch next to it. Every
:class:`~nvalchemi_ase.calculator.NVAlchemiCalculator` and view over a model
object, and every dynamics object stepping one, holds that object's lock
while it evaluates, so threads sharing a model take turns instead of reading
each other's outputs.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["model_lock"]

#: One lock per model object, shared by every calculator and view over it.
_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = (
    weakref.WeakKeyDictionary()
)
_UNWEAKABLE_LOCKS: dict[int, tuple[Any, threading.RLock]] = {}
_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """Return the lock that serialises evaluations of ``model`` (one per object).

    A model object keeps state between the steps of one evaluation
    (``narrowed_outputs`` sets its active outputs), so two threads may not
    run it at once. Every :class:`NVAlchemiCalculator` and view over the same
    model object takes this lock around building its batch, the neighbour
    list, the model call and reading the results back.

    Parameters
    ----------
    model : object
        The model object (identity, not equality, selects the lock).

    Returns
    -------
    threading.RLock
        Re-entrant, so a model that calls back into a calculator does not
        deadlock on itself.
    """
    with _LOCKS_GUARD:
        try:
            lock = _MODEL_LOCKS.get(model)
            if lock is None:
                lock = _MODEL_LOCKS[model] = threading.RLock()
        except TypeError:  # not weak-referenceable: keep it alive with its lock
            entry = _UNWEAKABLE_LOCKS.get(id(model))
            if entry is None or entry[0] is not model:
                entry = _UNWEAKABLE_LOCKS[id(model)] = (model, threading.RLock())
            lock = entry[1]
        return lock
