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

if TYPE_CHECKING:
    from ase import Atoms


__all__ = [
    "Frames",
    "Sink",
    "failed_path",
    "finished_indices",
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
    failed = failed_path(output) if failures is None else Path(failures)
    found: dict[int, Any] = {}
    for path in (Path(output), failed):
        frames = scan_frames(path)
        found.update(zip(frames.indices, frames.sources, strict=True))
    return found


def sort_output(path: str | Path) -> None:
    """Rewrite a runner's extxyz output in input order (``info["index"]``).

    Frames are moved as text, never parsed into structures: memory holds one
    offset per frame, and every number is kept to the last digit written. The
    file is replaced atomically (a sorted copy is renamed over it).

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
    order = sorted(range(len(frames.indices)), key=frames.indices.__getitem__)
    if order == list(range(len(order))):
        return
    staged = target.with_name(target.name + ".sorting")
    with target.open("rb") as source, staged.open("wb") as sorted_file:
        for position in order:
            start, end = frames.spans[position]
            source.seek(start)
            sorted_file.write(source.read(end - start))
    os.replace(staged, target)


class Sink:
    """Appends finished structures to ``output`` / its failures file, flushed."""

    def __init__(
        self,
        output: str | Path | None,
        resume: bool,
        failures: str | Path | None = None,
    ) -> None:
        self.done: set[int] = set()
        self._files: dict[bool, Any] = {}
        if output is None:
            if failures is not None:
                raise TypeError("failures= is the failures file of output=; give both")
            self._paths: dict[bool, Path] = {}
            return
        path = Path(output)
        self._paths = {
            False: path,
            True: failed_path(path) if failures is None else Path(failures),
        }
        if resume:
            for target in self._paths.values():
                self.done.update(scan_frames(target, repair=True).indices)
            return
        for target in self._paths.values():
            if target.exists() and target.stat().st_size:
                raise FileExistsError(
                    f"{target} exists; pass resume=True to continue that run, or "
                    "remove it"
                )

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
        write(text, frame, format="extxyz")
        handle.write(text.getvalue())  # one write per frame
        handle.flush()

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
    return list(iread(path, index=":", format="extxyz"))
