"""Data-parallel runners on torch.distributed: each rank relaxes its own shard.

Under a launcher that sets torch.distributed's environment (``torchrun``,
``srun`` with the variables exported, ``torch.multiprocessing`` with
``init_process_group``), the runners shard the input stream across ranks:
structure ``i`` belongs to rank ``i % world_size``. Every rank reads the whole
stream (a structure it does not own is skipped, not copied), builds its own
calculator on its own device (``cuda:LOCAL_RANK`` when CUDA is available and
no device is given), sizes its working batch to its share of the memory
(ranks on one CPU, or on one GPU, split it) and streams its results to a shard
file of its own next to the output (``out.rank1.extxyz``: see
:func:`shard_path`). When every rank has finished, rank 0 merges the shard
files (and what ``output`` already held) into ``output`` in input order,
replaces it atomically and only then removes the shard files; the list
functions (``relax``, ``single_points``, ``md``) return every structure, in
input order, on every rank.

``resume=True`` works per shard: each rank skips the indices already in
``output`` or in any shard file (so a run may be resumed with another number
of ranks, or in a single process), and the merge takes them all.

What is exchanged between ranks are a barrier and the result lists (pickled
``Atoms``, on a gloo group of the runners' own, whatever the default
backend): the structures themselves never cross ranks, and no rank waits for
another until the end. Ranks therefore finish at different times; the wait at
the end is bounded by the process group's timeout (a group the runners start
themselves gets :data:`GROUP_TIMEOUT`).

Nothing here is a home-made transport: torch.distributed's ``env://``
rendezvous, gloo collectives and ``all_gather_object``. A run with one rank (or
``distributed=False``) is exactly the single-process run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvalchemi_ase.devices import GROUP_TIMEOUT

if TYPE_CHECKING:
    import torch
    from ase import Atoms

__all__ = [
    "GROUP_TIMEOUT",
    "SINGLE",
    "Shard",
    "launched",
    "shard_files",
    "shard_path",
    "sharding",
]


@dataclass(frozen=True)
class Shard:
    """Which structures this process runs: those with ``index % size == rank``.

    Attributes
    ----------
    rank, size : int
        torch.distributed rank and world size (0 and 1 in a single process).
    local_rank, local_size : int
        Rank within the node and ranks on the node (``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``; the launcher sets them).
    group : object
        The gloo group of the runners' collectives (None: the default group,
        or a single process).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    group: Any = None

    @property
    def parallel(self) -> bool:
        """Whether more than one rank shares the run."""
        return self.size > 1

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0 (the one that merges and reports)."""
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Whether input ``index`` belongs to this rank."""
        return index % self.size == self.rank

    def numbered(self, structures: Iterable[Atoms]) -> Iterator[tuple[int, Atoms]]:
        """``(input index, atoms)`` of this rank's structures, lazily."""
        if not self.parallel:
            yield from enumerate(structures)
            return
        for index, atoms in enumerate(structures):
            if self.owns(index):
                yield index, atoms

    def owned_count(self, total: int) -> int:
        """How many of ``total`` inputs belong to this rank."""
        return len(range(self.rank, total, self.size))

    def device(self, device: Any) -> Any:
        """Return this rank's device: ``device`` if given, else its own GPU or CPU."""
        import torch

        if device is not None or not self.parallel or not torch.cuda.is_available():
            return device
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())

    def memory_sharers(self, device: torch.device) -> int:
        """Ranks of this node that share ``device``'s memory (CPU: all of them)."""
        import torch

        if not self.parallel:
            return 1
        if device.type == "cuda":
            gpus = max(torch.cuda.device_count(), 1)
            return max(1, -(-self.local_size // gpus))
        return self.local_size

    def seed(self, seed: int | None, chunk: int) -> int | None:
        """Return a seed for this rank's chunk ``chunk``, distinct across ranks."""
        return None if seed is None else int(seed) + chunk * self.size + self.rank

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.parallel:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def gather(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items``, concatenated in rank order, on every rank."""
        if not self.parallel:
            return items
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, items, group=self.group)
        return [item for part in gathered for item in part]


#: The single-process shard.
SINGLE = Shard()


def launched() -> bool:
    """Whether this process is one of several ranks (initialised or launched)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True
    if "torch" not in sys.modules:
        return False  # no process group can exist yet
    import torch.distributed as dist

    return bool(
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )


@contextlib.contextmanager
def sharding(distributed: bool | None = None) -> Iterator[Shard]:
    """Give this process's shard for the duration of one runner call.

    Parameters
    ----------
    distributed : bool or None
        None: shard when launched as one of several ranks (:func:`launched`);
        False: run everything here; True: require a distributed launch.

    Yields
    ------
    Shard
        This process's shard. A process group that is not initialised yet is
        started from the launcher's environment (``env://``, gloo, timeout
        :data:`GROUP_TIMEOUT`) and kept for the launch's later runner calls
        (destroyed when the interpreter exits); one the caller started
        is used as it is, with a gloo group of the runners' own (destroyed on
        exit).

    Raises
    ------
    RuntimeError
        With ``distributed=True`` outside a distributed launch.
    """
    if distributed is False or (distributed is None and not launched()):
        yield SINGLE
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("distributed=True needs a torch built with distributed")
    started = False
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ and distributed:
            raise RuntimeError(
                "distributed=True but no launcher environment (RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT); start the script with torchrun"
            )
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
        # kept for the next runner call of this launch: gloo cannot start a
        # second default group from the same rendezvous once one is destroyed
        atexit.register(_destroy_default_group)
        started = True
    # A group of the runners' own (gloo, long timeout) unless they started one.
    group = None if started else dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    size = dist.get_world_size()
    shard = Shard(
        rank=dist.get_rank(),
        size=size,
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", size)),
        group=group,
    )
    try:
        yield shard
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _destroy_default_group() -> None:
    """Destroy the default process group a runner started (at interpreter exit)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def shard_path(path: str | Path, rank: int) -> Path:
    """Return the file rank ``rank`` streams ``path``'s results to.

    ``out.extxyz`` → ``out.rank1.extxyz``.
    """
    target = Path(path)
    return target.with_name(f"{target.stem}.rank{rank}{target.suffix}")


def shard_files(path: str | Path) -> list[Path]:
    """List the shard files of ``path`` on disk (any rank, any number of ranks)."""
    target = Path(path)
    pattern = re.compile(
        rf"{re.escape(target.stem)}\.rank\d+{re.escape(target.suffix)}"
    )
    if not target.parent.is_dir():
        return []
    return sorted(
        candidate
        for candidate in target.parent.iterdir()
        if pattern.fullmatch(candidate.name)
    )
