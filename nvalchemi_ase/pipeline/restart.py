"""Checkpoints of ``optimizer | md`` (``restart=``): a manifest, one file per rank.

``PATH`` (the pipeline's ``restart=``) is the manifest, a checkpoint of
:mod:`nvalchemi_ase.dynamics.checkpoint`'s format holding the step, the state
both ranks share (stages, hand-over steps, failures), the job's identity
(digests of the structures as given and of the model, the settings) and the
names of the two rank files beside it (``STEM.rank0.stepN SUFFIX``,
``STEM.rank1.stepN SUFFIX``): each a checkpoint of the rank's part
(``write_checkpoint``, continued with ``continue_from``) with the rank's
bookkeeping as tags (``extra/tag/<name>``), or the tags alone while rank 1
holds no MD batch. Both ranks write their new file, then rank 0 replaces the
manifest (``os.replace``), then each rank removes its previous file: a kill
at any point leaves a manifest naming two files of one step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from nvalchemi_ase.dynamics.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_fix,
    read_checkpoint,
)
from nvalchemi_ase.dynamics.checkpoint import write_checkpoint as save_checkpoint
from nvalchemi_ase.dynamics.job import job_entries, job_mismatch
from nvalchemi_ase.identity import MD_FIELDS, structure_digests

__all__ = [
    "FRAMES_TAG",
    "LOG_TAG",
    "OPTIMIZER_FRAMES_TAG",
    "RANKS",
    "Job",
    "PipelineCheckpoints",
    "RankState",
    "job_identity",
    "restartable",
    "saved_states",
    "states_to_save",
    "structure_state",
    "write_tags",
]

#: ``meta["kind"]`` of the manifest and of a rank file without an MD batch.
_MANIFEST_KIND = "relax-then-md-pipeline"
_RANK_KIND = "relax-then-md-pipeline-rank"
#: Ranks of the pipeline (rank 0 relaxes, rank 1 runs MD).
RANKS = 2
#: Tags of a rank's file: frames in its hidden trajectory files, log size.
FRAMES_TAG, LOG_TAG = "frames", "log_size"
#: Tag of rank 0's file: frames in the optimizer's own trajectories.
OPTIMIZER_FRAMES_TAG = "optimizer_frames"
#: Entries of the parts' ``todict()`` that a continued run may change.
_VOLATILE = frozenset({"restart", "max_steps", "fmax"})


class Restartable(Protocol):
    """The checkpoint members of this package's dynamics classes."""

    checkpoint_tags: dict[str, npt.NDArray[Any]]
    #: The nvalchemi engine (its public ``step_count``).
    engine: Any

    def write_checkpoint(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write a checkpoint of the current state."""

    def continue_from(self, path: str | os.PathLike[str]) -> None:
        """Take the state of a checkpoint."""


def restartable(part: Any) -> Restartable:
    """Return ``part`` seen through its checkpoint members."""
    return cast(Restartable, part)


@dataclass(frozen=True)
class RankState:
    """One rank's file of a checkpoint: its path and bookkeeping tags."""

    path: Path
    tags: dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class Job:
    """What a checkpoint must belong to: inputs, model and settings."""

    settings: dict[str, Any]
    meta: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]


def job_identity(pipeline: Any, trajectories: list[Path], logfile: Any) -> Job:
    """Digests of the inputs and model, and the settings, before any step.

    Files count by name (a run's folder may be moved between a stop and its
    continuation, the hidden frame files and the checkpoint with it).
    """
    md = pipeline.md

    def lasting(description: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in description.items() if k not in _VOLATILE}

    log: Any = None
    if isinstance(logfile, str | os.PathLike):
        log = Path(logfile).name
    elif logfile is not None:
        log = "open file"
    settings = {
        "optimizer": lasting(pipeline.optimizer.todict()),
        "md": lasting(md.todict()),
        "fmax": pipeline.fmax,
        "md_steps": pipeline.md_steps,
        "loginterval": pipeline.loginterval,
        "trajectory": [path.name for path in trajectories],
        "logfile": log,
    }
    own = pipeline.optimizer.trajectories
    if own:  # its files continue with the job's (absent before they could)
        settings["optimizer_trajectory"] = [
            None if path is None else path.name for path in own.paths
        ]
    meta, arrays = job_entries(
        md.model, md.setup.dtype, structure_digests(pipeline.images, MD_FIELDS)
    )
    plain = json.loads(json.dumps(settings, default=_plain))
    return Job(settings=plain, meta=meta, arrays=arrays)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    return str(value)


class PipelineCheckpoints:
    """The pipeline's checkpoint: a manifest naming one file per rank.

    ``PATH`` (``restart=``) is the manifest, an ``nvalchemi_ase`` checkpoint
    holding the step, the state both ranks share (stages, hand-over steps,
    failures), the job's identity and the names of the two rank files
    (``STEM.rank0.stepN SUFFIX``, ``STEM.rank1.stepN SUFFIX`` beside it).
    Both ranks write their new files, then rank 0 replaces the manifest
    (``os.replace``), then each rank removes its previous file: a kill at any
    point leaves a manifest naming a pair written at the same step.
    """

    def __init__(self, manifest: Path, job: Job) -> None:
        self.manifest = manifest
        self.job = job
        #: This rank's file named by the manifest (removed once replaced).
        self.current: Path | None = None
        self.written_at = -1
        self._files: list[str] = []

    def rank_path(self, rank: int, nsteps: int) -> Path:
        """Return the file of ``rank`` at step ``nsteps``, beside the manifest."""
        path = self.manifest
        return path.with_name(f"{path.stem}.rank{rank}.step{nsteps}{path.suffix}")

    # -- reading -----------------------------------------------------------

    def read(self, images: list[Any], md: Any) -> Checkpoint | None:
        """Return the manifest, checked against the job (None: no checkpoint yet)."""
        if not self.manifest.exists():
            return None
        manifest = read_checkpoint(self.manifest)
        path = self.manifest
        if manifest.meta.get("kind") != _MANIFEST_KIND:
            raise CheckpointError(
                f"restart file {path} is not a checkpoint of optimizer | md (it "
                f"was written by {manifest.meta.get('class', 'another run')}); "
                "give the pipeline its own restart path"
            )
        _same_settings(path, manifest.meta.get("settings"), self.job.settings)
        mismatch = job_mismatch(
            images, md.model, md.setup.dtype, manifest.meta, manifest.arrays
        )
        if mismatch is not None:
            raise CheckpointError(
                f"restart file {path}: {mismatch}; {checkpoint_fix()}"
            )
        self._files = [str(name) for name in manifest.meta["rank_files"]]
        for name in self._files:
            if not (path.parent / name).exists():
                raise CheckpointError(
                    f"restart file {path} names {name}, which is missing beside it "
                    "(a checkpoint is the manifest and one file per rank); restore "
                    f"it, or remove {path} to start afresh"
                )
        self.written_at = int(manifest.meta["nsteps"])
        return manifest

    def rank_state(self, rank: int) -> RankState:
        """Return this rank's file of the manifest read; remove stale ones."""
        path = self.manifest.parent / self._files[rank]
        checkpoint = read_checkpoint(path)
        self.current = path
        stem, suffix = self.manifest.stem, self.manifest.suffix
        for stale in self.manifest.parent.glob(f"{stem}.rank{rank}.step*{suffix}"):
            if stale.name != path.name:  # written after the manifest: a kill
                stale.unlink(missing_ok=True)
        return RankState(path=path, tags=checkpoint.group("extra/tag"))

    # -- writing -----------------------------------------------------------

    def write_if_due(
        self,
        pipeline: Any,
        stage: Any,
        frames: Any,
        group: Any,
        *,
        ending: bool,
    ) -> None:
        """Write both ranks' files and the manifest (collective), when due.

        Due every ``restart_interval`` steps and when the run ends, after the
        exchange: every structure handed over is in the MD batch, none in
        transit.
        """
        import torch.distributed as dist

        nsteps = pipeline.nsteps
        due = ending or nsteps % pipeline.restart_interval == 0
        if not due or nsteps == self.written_at:
            return
        rank = dist.get_rank()
        log = pipeline.log_path(rank)
        size = log.stat().st_size if log is not None and log.exists() else -1
        path = self.rank_path(rank, nsteps)
        stage.write_checkpoint(
            path,
            {
                FRAMES_TAG: pipeline.frame_counts(frames),
                LOG_TAG: np.array([size], dtype=np.int64),
            },
        )
        dist.barrier(group=group)  # both rank files are whole
        if rank == 0:  # rank 0 (the optimizer's) writes the manifest
            files = [self.rank_path(r, nsteps).name for r in range(RANKS)]
            meta = {
                "kind": _MANIFEST_KIND,
                "nsteps": nsteps,
                "rank_files": files,
                "settings": self.job.settings,
                **self.job.meta,
            }
            arrays = self.job.arrays | pipeline.shared_arrays()
            save_checkpoint(self.manifest, meta, arrays)
        dist.barrier(group=group)  # the manifest names the new pair
        if self.current is not None and self.current != path:
            self.current.unlink(missing_ok=True)
        self.current = path
        self.written_at = nsteps


def _same_settings(path: Path, saved: Any, current: dict[str, Any]) -> None:
    """Refuse a manifest written with other settings, naming the first one."""
    if saved == current:
        return
    field, mine, theirs = _first_difference(saved, current, "")
    raise CheckpointError(
        f"restart file {path}: setting {field!r} is {mine!r} in the checkpoint but "
        f"{theirs!r} here (another job); {checkpoint_fix()}"
    )


def _first_difference(saved: Any, current: Any, prefix: str) -> tuple[str, Any, Any]:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            if saved.get(key) != current.get(key):
                name = f"{prefix}.{key}" if prefix else str(key)
                return _first_difference(saved.get(key), current.get(key), name)
    return prefix or "settings", saved, current


def states_to_save(
    indices: npt.NDArray[np.intp], images: list[Any]
) -> dict[str, npt.NDArray[Any]]:
    """Return the final states of ``indices`` as checkpoint tags (``final/...``)."""
    states = [
        structure_state(int(index), images[index], momenta=True)[1] for index in indices
    ]

    def stacked(key: str, shape: tuple[int, ...]) -> npt.NDArray[np.float64]:
        if not states:
            return np.zeros((0, *shape))
        return np.concatenate(
            [np.reshape(state[key], (-1, *shape)) for state in states]
        )

    return {
        "final/index": np.asarray(indices, dtype=np.int64),
        "final/positions": stacked("positions", (3,)),
        "final/cell": stacked("cell", (3, 3)),
        "final/momenta": stacked("momenta", (3,)),
        "final/energy": np.array(
            [state["results"]["energy"] for state in states], dtype=np.float64
        ),
        "final/forces": np.concatenate([state["results"]["forces"] for state in states])
        if states
        else np.zeros((0, 3)),
    }


def saved_states(
    tags: dict[str, npt.NDArray[Any]], images: list[Any]
) -> list[tuple[int, dict[str, Any]]]:
    """Return the final states :func:`states_to_save` stored (``write_back``)."""
    states = []
    start = 0
    for position, index in enumerate(tags["final/index"].tolist()):
        stop = start + len(images[index])
        energy = float(tags["final/energy"][position])
        states.append(
            (
                index,
                {
                    "positions": tags["final/positions"][start:stop],
                    "cell": tags["final/cell"][position],
                    "momenta": tags["final/momenta"][start:stop],
                    "results": {
                        "energy": energy,
                        "free_energy": energy,
                        "forces": tags["final/forces"][start:stop],
                    },
                },
            )
        )
        start = stop
    return states


def structure_state(
    index: int, atoms: Any, *, momenta: bool
) -> tuple[int, dict[str, Any]]:
    """Return what the other rank needs to hold structure ``index``'s final state."""
    results = {
        "energy": atoms.get_potential_energy(),
        "free_energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(apply_constraint=False),
    }
    return (
        index,
        {
            "positions": atoms.positions.copy(),
            "cell": atoms.cell.array.copy(),
            "momenta": atoms.get_momenta() if momenta else None,
            "results": results,
        },
    )


def write_tags(path: Path, rank: int, tags: dict[str, Any]) -> None:
    """Write a rank's bookkeeping alone (rank 1 while it holds no MD batch)."""
    arrays = {f"extra/tag/{name}": np.asarray(value) for name, value in tags.items()}
    save_checkpoint(path, {"kind": _RANK_KIND, "rank": rank}, arrays)
