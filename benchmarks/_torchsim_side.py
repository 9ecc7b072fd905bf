"""TorchSim's side of :mod:`benchmarks.torchsim`, run by TorchSim's interpreter.

TorchSim 0.6 needs Python >= 3.12 and this project runs on 3.11, so this file
runs as a subprocess of another interpreter (``NVALCHEMI_ASE_TORCHSIM_PYTHON``)
and imports only ``torch_sim``, ``torch``, ``ase``, ``numpy`` and ``sevenn``:
nothing of ``nvalchemi_ase`` or ``benchmarks``.

Protocol: one JSON request per line on standard input, one JSON reply per line
on standard output (anything the libraries print goes to standard error).
Requests (``op``):

* ``versions``: of TorchSim, torch, ASE, sevenn and Python; torch threads.
* ``load``: ``path`` (extxyz), ``model`` (``{"name": "lj", "epsilon",
  "sigma", "cutoff"}`` or ``{"name": "sevennet-0"}``), ``dtype``.
* ``static``: energies (eV) and forces (eV/Å) of the loaded structures.
* ``relax`` and ``md`` run the first ``count`` structures (all if absent).
* ``relax``: ``ts.optimize`` with ASE-flavoured FIRE and its
  ``InFlightAutoBatcher`` (``max_atoms`` atoms), forces-only convergence
  (largest per-atom force norm below ``fmax``); ``max_steps``,
  ``steps_between_swaps``.
* ``md``: ``ts.integrate`` NVE for ``n_steps`` of ``timestep_ps`` from the
  structures' own momenta, ``BinningAutoBatcher`` of ``max_atoms`` atoms.

``relax`` and ``md`` reply with ``wall`` and ``cpu`` (seconds, this process)
of the whole call: state built from the ``Atoms``, the run, results back to
``Atoms``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from importlib.metadata import version
from typing import Any

import numpy as np
import torch

torch.set_num_threads(1)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch_sim as ts
    from ase.io import read
    from torch_sim.autobatching import BinningAutoBatcher, InFlightAutoBatcher
    from torch_sim.optimizers import fire_init, fire_step
    from torch_sim.runners import generate_force_convergence_fn

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Side:
    """The loaded structures and model."""

    def __init__(self) -> None:
        self.structures: list[Any] = []
        self.model: Any = None
        self.dtype = torch.float64

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        self.structures = list(read(request["path"], index=":"))
        for index, atoms in enumerate(self.structures):
            atoms.info["bench_index"] = index
        self.dtype = DTYPES[request["dtype"]]
        spec = request["model"]
        if spec["name"] == "lj":
            from torch_sim.models.lennard_jones import LennardJonesModel

            self.model = LennardJonesModel(
                sigma=spec["sigma"],
                epsilon=spec["epsilon"],
                cutoff=spec["cutoff"],
                dtype=self.dtype,
                device=torch.device("cpu"),
            )
        elif spec["name"] == "sevennet-0":
            from sevenn.torchsim import SevenNetModel

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.model = SevenNetModel("7net-0", device="cpu", dtype=self.dtype)
        else:
            raise ValueError(f"unknown model {spec['name']!r}")
        return {"structures": len(self.structures)}

    def versions(self, request: dict[str, Any]) -> dict[str, Any]:
        del request
        return {
            "versions": {
                name: version(name)
                for name in ("torch-sim-atomistic", "torch", "ase", "sevenn")
            },
            "python": sys.version.split()[0],
            "threads": torch.get_num_threads(),
        }

    def state(self, count: int | None = None) -> Any:
        return ts.io.atoms_to_state(
            self.structures[:count],
            device=torch.device("cpu"),
            dtype=self.dtype,
            system_extras_map={"bench_index": "bench_index"},
        )

    def static(self, request: dict[str, Any]) -> dict[str, Any]:
        del request
        output = self.model(self.state())
        forces = output["forces"].detach().double().numpy()
        sizes = [len(atoms) for atoms in self.structures]
        return {
            "energies": output["energy"].detach().double().tolist(),
            "forces": [f.tolist() for f in np.split(forces, np.cumsum(sizes)[:-1])],
        }

    def relax(self, request: dict[str, Any]) -> dict[str, Any]:
        count = request.get("count")
        structures = self.structures[:count]
        counts = torch.zeros(len(structures), dtype=torch.long)

        def counted_step(state: Any, **kwargs: Any) -> Any:
            counts[state.system_extras["bench_index"].long()] += 1
            return fire_step(state, **kwargs)

        batcher = InFlightAutoBatcher(
            self.model,
            memory_scales_with="n_atoms",
            max_memory_scaler=float(request["max_atoms"]),
        )
        wall, cpu = time.perf_counter(), time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "all systems reached max steps"
            final = ts.optimize(
                self.state(count),
                self.model,
                optimizer=(fire_init, counted_step),
                convergence_fn=generate_force_convergence_fn(request["fmax"]),
                max_steps=request["max_steps"],
                steps_between_swaps=request["steps_between_swaps"],
                autobatcher=batcher,
                init_kwargs={"fire_flavor": "ase_fire"},
                fire_flavor="ase_fire",
            )
        atoms = final.to_atoms()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        fmax = ts.system_wise_max_force(final)
        order = final.system_extras["bench_index"].long().tolist()
        if order != list(range(len(structures))):
            raise RuntimeError(f"results out of input order: {order[:10]}...")
        return {
            "wall": wall,
            "cpu": cpu,
            "steps": counts.tolist(),
            "energies": final.energy.detach().double().tolist(),
            "fmax": fmax.detach().double().tolist(),
            "positions": [a.positions.tolist() for a in atoms],
        }

    def md(self, request: dict[str, Any]) -> dict[str, Any]:
        count = request.get("count")
        momenta = [
            torch.as_tensor(atoms.get_momenta(), dtype=self.dtype)
            for atoms in self.structures[:count]
        ]

        def init_with_momenta(state: Any, model: Any, **kwargs: Any) -> Any:
            # nve_init keeps momenta a state carries; a SimState built from Atoms
            # carries none, so give each bin its structures' own
            index = state.system_extras["bench_index"].long().tolist()
            state.momenta = torch.cat([momenta[i] for i in index])
            return ts.integrators.nve_init(state, model, **kwargs)

        batcher = BinningAutoBatcher(
            self.model,
            memory_scales_with="n_atoms",
            max_memory_scaler=float(request["max_atoms"]),
        )
        wall, cpu = time.perf_counter(), time.process_time()
        final = ts.integrate(
            self.state(count),
            self.model,
            integrator=(init_with_momenta, ts.integrators.nve_step),
            n_steps=request["n_steps"],
            temperature=0.0,  # unused: the momenta are given
            timestep=request["timestep_ps"],
            autobatcher=batcher,
        )
        atoms = final.to_atoms()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return {
            "wall": wall,
            "cpu": cpu,
            "energies": final.energy.detach().double().tolist(),
            "positions": [a.positions.tolist() for a in atoms],
        }


def main() -> None:
    """Answer requests until standard input closes."""
    replies = sys.stdout
    sys.stdout = sys.stderr  # library prints must not corrupt the protocol
    side = Side()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = getattr(side, request["op"])(request)
            reply["ok"] = True
        except Exception as error:  # reported to the parent, which raises
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
