"""One rank of the distributed runner tests (``torchrun -m tests.distributed_worker``).

``python -m torch.distributed.run --standalone --nproc_per_node=N -m
tests.distributed_worker KIND FOLDER [COUNT]`` runs one runner (``relax``,
``single_points`` or ``md``) over :func:`tests.structures.mixed` with the LJ
model in float64 on the CPU, streaming to ``FOLDER/out.extxyz``, and writes
what the list function returned on this rank to ``FOLDER/returned.rankR.extxyz``
(every rank gets every structure). The test compares both with a
single-process run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Keyword arguments of each runner in these tests (shared with the test).
RUNS = {
    "relax": {"optimizer": "FIRE", "fmax": 0.02, "steps": 400, "max_atoms": 160},
    "single_points": {"properties": ("energy", "forces", "stress"), "max_atoms": 160},
    "md": {
        "dynamics": "VelocityVerlet",
        "timestep": 5.0,  # ASE time units (~0.5 fs)
        "steps": 10,
        "max_atoms": 160,
    },
}


def main() -> None:
    from nvalchemi_ase import NVAlchemiCalculator, runners
    from tests.helpers import write_results
    from tests.structures import mixed

    kind, folder = sys.argv[1], Path(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
    returned = getattr(runners, kind)(
        mixed(count),
        calc,
        output=folder / "out.extxyz",
        resume="--resume" in sys.argv,
        **RUNS[kind],
    )
    rank = os.environ.get("RANK", "0")
    write_results(folder / f"returned.rank{rank}.extxyz", returned)


if __name__ == "__main__":
    main()
