"""One rank of the distributed runner tests (``torchrun -m tests.distributed_worker``).

``python -m torch.distributed.run --standalone --nproc_per_node=N -m
tests.distributed_worker KINDS FOLDER [COUNT]`` runs each runner of ``KINDS``
(comma-separated: ``relax``, ``single_points``, ``md``) in turn, with a
calculator of its own, over :func:`tests.structures.mixed` with the LJ model in
float64 on the CPU, streaming to ``FOLDER/KIND/out.extxyz``, and writes what the
list function returned on this rank to ``FOLDER/KIND/returned.rankR.extxyz``
(every rank gets every structure). The test compares both with a
single-process run. One launch runs several kinds: each start-up (torchrun and
two interpreters importing torch and nvalchemi) costs more than a run here.
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

    kinds, folder = sys.argv[1].split(","), Path(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    rank = os.environ.get("RANK", "0")
    # No process group of the script's own: the first runner starts the
    # default group and the later ones of the launch reuse it.
    for kind in kinds:
        (folder / kind).mkdir(parents=True, exist_ok=True)
        calc = NVAlchemiCalculator("lj", device="cpu", dtype="float64")
        returned = getattr(runners, kind)(
            mixed(count),
            calc,
            output=folder / kind / "out.extxyz",
            resume="--resume" in sys.argv,
            **RUNS[kind],
        )
        write_results(folder / kind / f"returned.rank{rank}.extxyz", returned)


if __name__ == "__main__":
    main()
