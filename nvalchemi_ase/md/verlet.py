"""``VelocityVerlet``: constant NVE on nvalchemi's ``NVE`` engine."""

from __future__ import annotations

from typing import Any

from nvalchemi_ase._quiet import import_quietly
from nvalchemi_ase.md.md import BatchedMolecularDynamics
from nvalchemi_ase.units import ase_time_to_fs

__all__ = ["VelocityVerlet"]


class VelocityVerlet(BatchedMolecularDynamics):
    """Velocity Verlet (NVE) for many structures at once, as ``ase.md.VelocityVerlet``.

    Parameters
    ----------
    images : ase.Atoms or sequence of ase.Atoms
        Structures with their momenta (Å·amu/ASE-time; zero when unset).
    timestep : float
        Time step, ASE time units (``1 * ase.units.fs`` = 1 fs).
    trajectory : str, path, Trajectory, list, or None
        Per-structure trajectories (template with ``{i}`` for several).
    logfile : file, str or None
        ASE's ``MDLogger`` columns for one structure; see
        :mod:`nvalchemi_ase.dynamics.logs` for batches.
    loginterval : int
        Steps between trajectory frames and log lines.
    **kwargs
        ``model``, ``device``, ``dtype``, ``append_trajectory``,
        ``neighbor_skin`` (see :class:`~nvalchemi_ase.dynamics.base.BatchedDynamics`).

    Examples
    --------
    >>> dyn = VelocityVerlet(images, 2 * units.fs, trajectory="md_{i}.traj")
    >>> dyn.run(100)
    """

    #: nvalchemi's NVE keeps no per-structure state: ``resize`` admits and
    #: retires structures in place (``optimizer | md`` relies on it).
    resizes_in_place = True

    def build_engine(self, hooks: list[Any]) -> Any:
        """Build the nvalchemi engine (engine protocol, see ``BatchedDynamics``)."""
        dynamics = import_quietly("nvalchemi.dynamics")
        return dynamics.NVE(self.model, dt=ase_time_to_fs(self.dt), hooks=hooks)

    def _post_update_writes(self) -> tuple[str, ...] | None:
        """Velocities: nvalchemi's ``NVE.post_update`` is the second half kick."""
        nve = import_quietly("nvalchemi.dynamics").NVE
        if type(self.engine) is nve:
            return ("velocities",)
        return super()._post_update_writes()
