"""Streamed output files: one flushed extxyz frame per structure, resume, sorting.

A frame is the record of a finished structure (``info["index"]`` its input
index), so after a kill the files themselves say what is done;
:func:`scan_frames` reads only their comment lines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nvalchemi_ase.io_safe import decoded_frame, encoded_frame

if TYPE_CHECKING:
    from ase import Atoms

    from nvalchemi_ase.runners.distributed import Shard


__all__ = [
    "Frames",
    "Sink",
    "failed_path",
    "finished_indices",
    "merge_shards",
    "read_frames",
    "read_results",
    "scan_frames",
    "sort_output",
]


def failed_path(output: str | Path) -> Path:
    """Where failures of a run with ``output`` go: ``<stem>.failed.extxyz``."""
    path = Path(output)
    return path.with_name(f"{path.stem}.failed.extxyz")


def read_results(
    path: str | Path, *, failures: bool | str | Path = True
) -> list[Atoms]:
    """Read a run's output back in input order.

    Parameters
    ----------
    path : str or path
        The ``output`` of a runner.
    failures : bool, str or path
        Include the failed structures: True reads :func:`failed_path`, a path
        reads that file (the run's ``failures=``), False none.

    Returns
    -------
    list of ase.Atoms
        Sorted by ``info["index"]``; ``info["failure"]`` is None for the others.
    """
    frames = read_frames(Path(path))
    if failures is not False:
        failed = failed_path(path) if failures is True else Path(failures)
        frames += read_frames(failed)
    for atoms in frames:
        atoms.info.setdefault("failure", None)
    return sorted(frames, key=lambda atoms: int(atoms.info["index"]))


def finished_indices(
    output: str | Path, failures: str | Path | None = None
) -> dict[int, Any]:
    """Input indices a run has written to ``output`` or its failures file.

    What ``resume=True`` skips (a frame cut off mid-write is not counted);
    only the comment line of each frame is read.

    Parameters
    ----------
    output : str or path
        The run's ``output``.
    failures : str or path, optional
        Its ``failures`` (default :func:`failed_path`).

    Returns
    -------
    dict of int to str or None
        Each index with the ``source`` of its frame's ``info`` (None without
        one; the command line writes ``file@frame`` there).
    """
    from nvalchemi_ase.runners.distributed import shard_files

    failed = failed_path(output) if failures is None else Path(failures)
    found: dict[int, Any] = {}
    for target in (Path(output), failed):
        for path in [target, *shard_files(target)]:
            frames = scan_frames(path)
            found.update(zip(frames.indices, frames.sources, strict=True))
    return found


def sort_output(path: str | Path) -> None:
    """Rewrite a runner's extxyz output in input order (``info["index"]``).

    Frames are moved as text, never parsed into structures: memory holds one
    offset per frame, and every number is kept to the last digit written. An
    index that appears twice keeps its first frame. The file is replaced
    atomically (a sorted copy is renamed over it).

    Parameters
    ----------
    path : str or path
        A complete output file (every frame whole, each with ``index``).

    Raises
    ------
    ValueError
        If a frame is cut off or has no ``index``.
    """
    target = Path(path)
    frames = scan_frames(target)
    if frames.damaged:
        raise ValueError(f"{target}: the last frame is cut off; cannot sort it")
    if frames.indices == sorted(frames.indices):
        return
    _write_in_input_order(target, [(target, frames)])


def merge_shards(path: str | Path) -> None:
    """Merge the shard files of a distributed run into ``path``, in input order.

    ``path``'s own frames (an earlier run's, when resumed) and the complete
    frames of every shard file (:func:`~nvalchemi_ase.runners.distributed.
    shard_files`; a frame cut off mid-write is left out) are written, each
    index once, to a copy renamed over ``path``; the shard files are removed
    only after that. Frames are moved as text (every digit kept). No shard
    files: nothing happens.

    Parameters
    ----------
    path : str or path
        The run's output (or failures) file.
    """
    from nvalchemi_ase.runners.distributed import shard_files

    target = Path(path)
    shards = shard_files(target)
    if not shards:
        return
    parts = [(source, scan_frames(source)) for source in [target, *shards]]
    if any(frames.indices for _, frames in parts):
        _write_in_input_order(target, parts)
    for source in shards:
        source.unlink()


def _write_in_input_order(target: Path, parts: list[tuple[Path, Frames]]) -> None:
    """Write the frames of ``parts`` to ``target`` by index, each index once."""
    chosen: dict[int, tuple[Path, tuple[int, int]]] = {}
    for source, frames in parts:
        for index, span in zip(frames.indices, frames.spans, strict=True):
            chosen.setdefault(index, (source, span))
    staged = target.with_name(target.name + ".sorting")
    handles: dict[Path, Any] = {}
    try:
        with staged.open("wb") as merged:
            for index in sorted(chosen):
                source, (start, end) = chosen[index]
                if source not in handles:
                    handles[source] = source.open("rb")
                handles[source].seek(start)
                merged.write(handles[source].read(end - start))
            merged.flush()
            os.fsync(merged.fileno())
    finally:
        for handle in handles.values():
            handle.close()
    os.replace(staged, target)


class Sink:
    """Appends finished structures to ``output`` / its failures file, flushed.

    In a distributed run (``shard.parallel``) each rank appends to its shard
    file (:func:`~nvalchemi_ase.runners.distributed.shard_path`) and
    :meth:`finish` merges them. Every rank checks the files before any rank
    writes (a barrier ends the constructor).
    """

    def __init__(
        self,
        output: str | Path | None,
        resume: bool,
        failures: str | Path | None = None,
        shard: Shard | None = None,
    ) -> None:
        from nvalchemi_ase.runners.distributed import SINGLE, shard_files, shard_path

        self.done: set[int] = set()
        self._files: dict[bool, Any] = {}
        self._shard = SINGLE if shard is None else shard
        if output is None:
            if failures is not None:
                raise TypeError("failures= is the failures file of output=; give both")
            self._targets: dict[bool, Path] = {}
            self._paths: dict[bool, Path] = {}
            return
        path = Path(output)
        self._targets = {
            False: path,
            True: failed_path(path) if failures is None else Path(failures),
        }
        self._paths = {
            failed: shard_path(target, self._shard.rank)
            if self._shard.parallel
            else target
            for failed, target in self._targets.items()
        }
        existing = {
            failed: [target, *shard_files(target)]
            for failed, target in self._targets.items()
        }
        if resume:
            for failed, paths in existing.items():
                for target in paths:
                    own = target == self._paths[failed]
                    self.done.update(scan_frames(target, repair=own).indices)
        else:
            for paths in existing.values():
                for target in paths:
                    if target.exists() and target.stat().st_size:
                        raise FileExistsError(
                            f"{target} exists; pass resume=True to continue that "
                            "run, or remove it"
                        )
        self._shard.barrier()

    def write(self, atoms: Atoms) -> None:
        """Append one result (failures to the failures file) and flush."""
        if not self._paths:
            return
        import io

        from ase.io import write

        failed = atoms.info.get("failure") is not None
        handle = self._files.get(failed)
        if handle is None:
            path = self._paths[failed]
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = self._files[failed] = path.open("a")
        text = io.StringIO()
        frame = atoms.copy()
        frame.calc = atoms.calc
        if frame.info.get("failure") is None:
            frame.info.pop("failure", None)
        write(text, encoded_frame(frame), format="extxyz")  # every frame reads back
        handle.write(text.getvalue())  # one write per frame
        handle.flush()

    def finish(self) -> None:
        """After the last result: close, and merge the shard files (rank 0)."""
        self.close()
        if not self._targets:
            return
        self._shard.barrier()
        if self._shard.is_root:
            for target in self._targets.values():
                merge_shards(target)
        self._shard.barrier()

    def close(self) -> None:
        """Close the files."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()


@dataclass
class Frames:
    """Where the complete frames of an extxyz file are, and their indices."""

    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) bytes
    indices: list[int] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)  # info["source"] or None
    damaged: bool = False  # bytes after the last complete frame


def scan_frames(path: Path, *, repair: bool = False) -> Frames:
    """Find the complete frames of an output file without parsing structures.

    A frame is complete when its atom-count line, its comment line and one
    line per atom are all there, each ended by a newline; only the comment is
    parsed (for ``index``). ``repair`` cuts the file after the last complete
    frame: what follows is a frame an interrupted write left unfinished.
    """
    from ase.io.extxyz import key_val_str_to_dict

    frames = Frames()
    if not path.exists():
        return frames
    size = path.stat().st_size
    end = 0
    with path.open("rb") as handle:
        while end < size:
            header = handle.readline()
            comment = handle.readline()
            try:
                natoms = int(header)
            except ValueError:
                break
            if not (header.endswith(b"\n") and comment.endswith(b"\n")):
                break
            if not all(handle.readline().endswith(b"\n") for _ in range(natoms)):
                break
            info = key_val_str_to_dict(comment.decode())
            if "index" not in info:
                raise ValueError(
                    f"{path}: frame {len(frames.indices)} has no index; it is not "
                    "the output of a nvalchemi_ase runner"
                )
            frames.spans.append((end, handle.tell()))
            frames.indices.append(int(info["index"]))
            frames.sources.append(info.get("source"))
            end = handle.tell()
    frames.damaged = end < size
    if frames.damaged and repair:
        os.truncate(path, end)
    return frames


def read_frames(path: Path) -> list[Atoms]:
    """Every frame of an output file (none when it does not exist)."""
    from ase.io import iread

    if not path.exists() or path.stat().st_size == 0:
        return []
    return [decoded_frame(atoms) for atoms in iread(path, index=":", format="extxyz")]
