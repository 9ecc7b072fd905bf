"""Shared machinery of the ASE-style batched dynamics (see ``md`` and ``optimize``)."""

from nvalchemi_ase.dynamics.base import DEFAULT_SKIN, BatchedDynamics

__all__ = ["DEFAULT_SKIN", "BatchedDynamics"]
