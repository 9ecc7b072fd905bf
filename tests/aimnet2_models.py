"""A small random-weight AIMNet2 written by aimnet's own exporter.

Only for tests and benchmarks: the weights are random (not physics). The model
is built with aimnet's constructor from aimnet's own model YAML with smaller
layers, and written by aimnet's exporter (``aimnet export``: the short-range
Coulomb embedded, long-range Coulomb and D3 left to the calculator), so that
nvalchemi's wrapper and aimnet's ``AIMNet2ASE`` read identical weights.
"""

from __future__ import annotations

import copy
import importlib.resources
from pathlib import Path

import torch
import yaml

#: Reference energies per element (eV), baked in as aimnet's exporter does.
SELF_ENERGIES = {1: -13.6, 6: -1030.0, 7: -1485.0, 8: -2040.0, 9: -2715.0}
SELF_ENERGIES |= {16: -10830.0, 17: -12520.0}


def save_random_aimnet2(folder: Path, seed: int = 7) -> Path:
    """Write ``folder/small_aimnet2.pt`` (aimnet's v2 format) and return its path."""
    from aimnet.config import build_module
    from aimnet.train.export_model import export_model

    config = yaml.safe_load(
        (importlib.resources.files("aimnet.models") / "aimnet2.yaml").read_text()
    )
    kwargs = config["kwargs"]
    kwargs.update(hidden=[[32, 24], [32, 24], [32, 24, 24]], aim_size=16)
    kwargs.update(nfeature=4, ncomb_v=4)
    energy_mlp = kwargs["outputs"]["energy_mlp"]["kwargs"]
    energy_mlp["n_in"] = 16
    energy_mlp["mlp"]["hidden"] = [16]
    (folder / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    network = build_module(copy.deepcopy(config))
    torch.random.set_rng_state(generator_state)
    torch.save(network.state_dict(), folder / "raw.pt")
    (folder / "sae.yaml").write_text(
        "\n".join(f"{z}: {e}" for z, e in SELF_ENERGIES.items())
    )
    export_model.callback(
        str(folder / "raw.pt"),
        str(folder / "small_aimnet2.pt"),
        str(folder / "model.yaml"),
        str(folder / "sae.yaml"),
        None,
        None,
        (),
    )
    return folder / "small_aimnet2.pt"
