"""Every tutorial runs as a notebook, as a user would run it, and shows its outputs.

The tutorials are written as jupytext percent scripts (``tutorials/NN_*.py``,
runnable with ``python``) and kept as notebooks beside them
(``tutorials/NN_*.ipynb``, ``make notebooks`` regenerates them); a test checks
the two hold the same cells, and the notebooks are executed in a real Jupyter
kernel (nbclient), so what a notebook user sees is what is tested: inline
plots, tables and progress widgets included. One kernel runs them all, each
tutorial after ``%reset -f`` in a folder of its own (a kernel's start and
imports cost more than most tutorials).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parents[1] / "tutorials").glob("[0-9][0-9]_*.py"))
# outputs each tutorial must leave in tutorial-output/ (non-empty)
EXPECTED = {
    "02_batched_relaxation": ["relax.png", "relax.log", "relax_0.traj"],
    "03_md_observers_hooks": ["langevin_0.traj"],
    "04_custom_integrator": ["verlet_0.traj", "bussi_0.traj"],
    "05_analysis": ["npt.png", "npt_3.traj"],
    "06_neb": ["neb_bands.png", "neb.traj"],
    "07_md_analysis": ["liquid_2.traj", "rdf_0.png", "transport_0.png"],
    "08_mace_d3": ["mace_d3_1.traj", "random.model"],
}
# the packages a tutorial needs beyond the test extra's core
NEEDS = {"08_mace_d3": ["mace", "tad_dftd3"]}
# what a notebook user must see in the cells' outputs (MIME types)
DISPLAYED = {
    "02_batched_relaxation": [
        "image/png",  # Recorder.plot() inline
        "text/html",  # the DataFrame
        "application/vnd.jupyter.widget-view+json",  # the progress widget
    ],
    "05_analysis": ["text/html"],
}
WIDGET = "application/vnd.jupyter.widget-view+json"


def _cells(notebook):
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_all_eight_tutorials_exist_as_scripts_and_notebooks():
    numbers = [path.name[:2] for path in TUTORIALS]
    assert numbers == ["01", "02", "03", "04", "05", "06", "07", "08"]
    for path in TUTORIALS:
        assert path.with_suffix(".ipynb").is_file(), path.name


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_notebook_holds_the_scripts_cells(path):
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    script = jupytext.read(path)
    notebook = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
    assert _cells(notebook) == _cells(script), (
        f"{path.with_suffix('.ipynb').name} is out of date: run `make notebooks`"
    )
    assert notebook.metadata["kernelspec"]["name"] == "python3"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One Jupyter kernel for every tutorial of this file, started as a user's is.

    A kernel's start (ipykernel, then torch and nvalchemi imported by the
    first cell) costs more CPU than most tutorials; each tutorial runs after
    ``%reset -f`` (its namespace empty: a name an earlier tutorial defined is
    an error again) in a folder of its own. The kernel imports this
    checkout's package, whatever is installed; the NEB tutorial is on
    SevenNet-0, its Lennard-Jones variant runs here.
    """
    pytest.importorskip("nbclient")
    jupyter_client = pytest.importorskip("jupyter_client")
    root = str(Path(__file__).parents[1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NVALCHEMI_ASE_TUTORIAL_MODEL", "lj")
        patch.setenv(
            "PYTHONPATH",
            os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        )
        manager = jupyter_client.KernelManager(kernel_name="python3")
        manager.start_kernel(cwd=str(tmp_path_factory.mktemp("kernel")))
    yield manager
    manager.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_notebook_runs(path, tmp_path, kernel):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for package in NEEDS.get(path.stem, []):
        pytest.importorskip(package)
    if not kernel.is_alive():  # an earlier tutorial took it down
        kernel.restart_kernel(now=True)
    notebook = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
    # a fresh namespace, in this tutorial's folder (no output of its own)
    fresh = f"%reset -f\nimport os\nos.chdir({str(tmp_path)!r})"
    notebook.cells.insert(0, nbformat.v4.new_code_cell(fresh))
    client = nbclient.NotebookClient(
        notebook, km=kernel, timeout=600, kernel_name="python3"
    )
    try:
        client.execute()  # raises CellExecutionError, with the traceback, on an error
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    shown = {mime for o in outputs for mime in o.get("data", {})}
    for mime in DISPLAYED.get(path.stem, []):
        if mime == WIDGET:
            pytest.importorskip("ipywidgets")
        assert mime in shown, (path.stem, mime, sorted(shown))
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Traceback" not in stderr
    assert "IProgress not found" not in stderr  # tqdm's widget-less fallback
    for name in EXPECTED.get(path.stem, []):
        output = tmp_path / "tutorial-output" / name
        assert output.stat().st_size > 1000, name
    for image in (tmp_path / "tutorial-output").glob("*.png"):
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
