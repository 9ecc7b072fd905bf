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
    from collections.abc import Sequence

    from ase import Atoms

    from nvalchemi_ase.identity import Job
    from nvalchemi_ase.runners.distributed import Shard

#: Frame ``info`` keys holding the job identity (:mod:`nvalchemi_ase.identity`):
#: the structure's digests, the model's and the algorithm's.
JOB_KEYS = ("job_input", "job_model", "job_run")


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
    if frames.broken:
        raise ValueError(
            f"{target}: frame {frames.broken[0][0]} is damaged; cannot sort it "
            "(resume the run to set it aside and compute it again)"
        )
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
        job: Job | None = None,
    ) -> None:
        from nvalchemi_ase.runners.distributed import SINGLE, shard_files, shard_path

        self.done: set[int] = set()
        self.job = job
        #: index -> (file, (job_input, job_model, job_run)) of the frames found
        self._recorded: dict[int, tuple[Path, tuple[Any, ...]]] = {}
        #: encoded structure digests of inputs identified but not written yet
        self._pending: dict[int, str] = {}
        #: written inputs already compared with their frames
        self._checked: set[int] = set()
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
                    frames = scan_frames(target, repair=own)
                    self.done.update(frames.indices)
                    for index, saved in zip(frames.indices, frames.jobs, strict=True):
                        self._recorded.setdefault(index, (target, saved))
        else:
            for paths in existing.values():
                for target in paths:
                    if target.exists() and target.stat().st_size:
                        raise FileExistsError(
                            f"{target} exists; pass resume=True to continue that "
                            "run, or remove it"
                        )
        self._shard.barrier()

    def identify(self, indices: Sequence[int], images: Sequence[Atoms]) -> None:
        """Digest these inputs; refuse any whose written result is another job's.

        Called with each chunk of inputs before any of it is evaluated (or
        skipped as done): the digests of those not written yet are kept for
        :meth:`write`; those already written are compared with their frame's
        (:func:`check_written`). Nothing happens without ``output``.

        Raises
        ------
        JobMismatchError
            Naming the input index, the field that differs and how to start afresh.
        """
        if not self._paths or self.job is None or not len(indices):
            return
        from nvalchemi_ase.identity import encode, structure_digests

        if self._checked:
            kept = [k for k, index in enumerate(indices) if index not in self._checked]
            indices, images = [indices[k] for k in kept], [images[k] for k in kept]
        digests = structure_digests(images, self.job.fields)
        for index, row in zip(indices, digests, strict=True):
            recorded = self._recorded.get(int(index))
            if recorded is None:
                self._pending[int(index)] = encode(row)
            else:
                check_written(recorded[0], int(index), recorded[1], row, self.job)
                self._checked.add(int(index))

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
        for key in JOB_KEYS:
            frame.info.pop(key, None)  # an input that is an earlier run's output
        if self.job is not None:
            digest = self._pending.pop(int(frame.info["index"]), None)
            if digest is not None:
                frame.info["job_input"] = digest
            frame.info["job_model"] = self.job.model
            frame.info["job_run"] = self.job.run
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
    jobs: list[tuple[Any, ...]] = field(default_factory=list)  # info[JOB_KEYS]
    damaged: bool = False  # bytes after the last complete frame
    #: (frame number, start, end) of damaged frames followed by complete ones
    broken: list[tuple[int, int, int]] = field(default_factory=list)


def scan_frames(path: Path, *, repair: bool = False) -> Frames:
    """Find the complete frames of an output file without parsing structures.

    A frame is complete when its atom-count line, its comment line (with
    ``index``) and one line per atom are all there, each ended by a newline,
    and the atom lines hold as many fields as the comment's ``Properties``
    declare; only the comment is parsed. A frame that is not complete but is
    followed by complete ones is *damaged* (:attr:`Frames.broken`, by frame
    number); one at the end is a frame an interrupted write left unfinished
    (:attr:`Frames.damaged`).

    ``repair`` makes the file hold only its complete frames: a cut-off end is
    cut; damaged frames are moved (bytes kept) to ``<name>.damaged`` next to
    it, with a warning naming each frame number, so that their structures are
    computed again while every complete frame after them is kept.
    """
    frames = Frames()
    if not path.exists():
        return frames
    size = path.stat().st_size
    position = 0
    with path.open("rb") as handle:
        while position < size:
            found = _frame_at(handle, position, path, first=not frames.spans)
            if found is not None:
                end, info = found
                frames.spans.append((position, end))
                frames.indices.append(int(info["index"]))
                frames.sources.append(info.get("source"))
                frames.jobs.append(tuple(info.get(key) for key in JOB_KEYS))
                position = end
                continue
            following = _next_frame(handle, position, path)
            if following is None:
                break  # the end was cut off mid-write
            number = len(frames.spans) + len(frames.broken)
            frames.broken.append((number, position, following))
            position = following
    frames.damaged = position < size
    if repair and frames.broken:
        _set_aside(path, frames)
        frames.damaged = False
    elif frames.damaged and repair:
        os.truncate(path, position)
    return frames


def _frame_at(
    handle: Any, position: int, path: Path, *, first: bool
) -> tuple[int, dict[str, Any]] | None:
    """(end, comment info) of the complete frame at ``position``, or None."""
    from ase.io.extxyz import key_val_str_to_dict

    handle.seek(position)
    header = handle.readline()
    comment = handle.readline()
    try:
        natoms = int(header)
    except ValueError:
        return None
    if natoms < 0 or not (header.endswith(b"\n") and comment.endswith(b"\n")):
        return None
    try:
        info = key_val_str_to_dict(comment.decode())
    except (ValueError, UnicodeDecodeError, IndexError):
        return None
    if "index" not in info:
        if first:
            raise ValueError(
                f"{path}: frame 0 has no index; it is not the output of a "
                "nvalchemi_ase runner"
            )
        return None
    lines = [handle.readline() for _ in range(natoms)]
    if not all(line.endswith(b"\n") for line in lines):
        return None
    width = _columns(info.get("Properties"))
    if width is not None and len(b"".join(lines).split()) != natoms * width:
        return None
    try:
        int(info["index"])
    except (TypeError, ValueError):
        return None
    return handle.tell(), info


def _columns(properties: Any) -> int | None:
    """Fields per atom line declared by an extxyz ``Properties`` string."""
    if not isinstance(properties, str):
        return None
    parts = properties.split(":")
    try:
        return sum(int(count) for count in parts[2::3])
    except ValueError:
        return None


def _next_frame(handle: Any, position: int, path: Path) -> int | None:
    """Start of the next complete frame after a damaged one at ``position``."""
    handle.seek(position)
    handle.readline()
    while True:
        start = handle.tell()
        line = handle.readline()
        if not line:
            return None
        if line.strip().isdigit():
            if _frame_at(handle, start, path, first=False) is not None:
                return start
            handle.seek(start)
            handle.readline()


def _set_aside(path: Path, frames: Frames) -> None:
    """Keep only the complete frames of ``path``; damaged ones go to ``.damaged``."""
    import re
    import warnings

    aside = path.with_name(path.name + ".damaged")
    staged = path.with_name(path.name + ".repairing")
    with path.open("rb") as source:
        with aside.open("ab") as damaged:
            for number, start, end in frames.broken:
                source.seek(start)
                text = source.read(end - start)
                damaged.write(text)
                found = re.search(rb"\bindex=(\d+)", text)
                which = f" (input {int(found.group(1))})" if found is not None else ""
                warnings.warn(
                    f"{path}: frame {number}{which} is damaged; its bytes were moved "
                    f"to {aside} and its structure is computed again (the "
                    "complete frames after it are kept)",
                    UserWarning,
                    stacklevel=4,
                )
        with staged.open("wb") as kept:
            for start, end in frames.spans:
                source.seek(start)
                kept.write(source.read(end - start))
            kept.flush()
            os.fsync(kept.fileno())
    os.replace(staged, path)
    position = 0
    for k, (start, end) in enumerate(frames.spans):
        frames.spans[k] = (position, position + end - start)
        position += end - start
    frames.broken = []


def read_frames(path: Path) -> list[Atoms]:
    """Every frame of an output file (none when it does not exist)."""
    from ase.io import iread

    if not path.exists() or path.stat().st_size == 0:
        return []
    frames = [decoded_frame(a) for a in iread(path, index=":", format="extxyz")]
    for atoms in frames:
        for key in JOB_KEYS:
            atoms.info.pop(key, None)
    return frames


def check_written(
    path: Path, index: int, saved: tuple[Any, ...], digests: Any, job: Job
) -> None:
    """Refuse a written result of input ``index`` that another job computed.

    Parameters
    ----------
    path : pathlib.Path
        The file holding the frame.
    index : int
        Its input index.
    saved : tuple
        The frame's ``job_input``, ``job_model`` and ``job_run`` (None each
        when the file predates job identities: not compared).
    digests : numpy.ndarray
        This run's digests of ``inputs[index]`` (:attr:`Job.fields`).
    job : Job
        This run's model and algorithm.

    Raises
    ------
    JobMismatchError
        Naming the file, the input index, what differs and the fix.
    """
    from nvalchemi_ase.identity import (
        JobMismatchError,
        decode,
        differing_fields,
        model_difference,
    )

    fix = (
        "resume with the inputs, model and parameters of the run that wrote it, "
        f"or start afresh: give another output path or remove {path} (on the "
        "command line: --overwrite)"
    )
    saved_input, saved_model, saved_run = saved
    if saved_model is not None and str(saved_model) != job.model:
        what = model_difference(str(saved_model), job.model)
        raise JobMismatchError(
            f"{path} holds the result of input {index} computed with another model "
            f"(differing in {what}: {saved_model} there, {job.model} here); {fix}",
            index=index,
            field="model",
        )
    if saved_run is not None and str(saved_run) != job.run:
        raise JobMismatchError(
            f"{path} holds the result of input {index} computed by another run "
            f"({saved_run} there, {job.run} here: another algorithm or other "
            f"parameters, e.g. fmax, steps, timestep, temperature); {fix}",
            index=index,
            field="run",
        )
    stored = decode(saved_input)
    if saved_input is None:
        return
    fields = (
        differing_fields(stored, digests, job.fields)
        if stored is not None
        else ["job_input"]
    )
    if fields:
        raise JobMismatchError(
            f"{path} holds the result of input {index} computed for another "
            f"structure: inputs[{index}] differs from it in "
            f"{', '.join(repr(f) for f in fields)}; {fix}",
            index=index,
            field=fields[0],
        )
