"""The notebooks in notebooks/ run from top to bottom (on small sizes), so they never rot.

Each notebook's cell tagged `parameters` is followed by an injected cell with smaller
sizes; the kernel is this interpreter (a kernel spec written for the test), and the
notebook's files go to a temporary directory.
"""

import json
import sys
from pathlib import Path

import patience
import pytest
from extended import with_extended

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SMALL_SIZES = {
    "quickstart.ipynb": "NUM_EXAMPLES = 256\nEPOCHS = 2",
    "mislabeled_examples.ipynb": "EPOCHS = 1",
    "explain_a_misprediction.ipynb": "EPOCHS = 2\nHELD_OUT = 100",
    # NUM_FEATURES not a multiple of CHUNK_SIZE: the padded last chunk runs too.
    "autodiff_1_output_feature_gradients.ipynb": (
        "BATCH_SIZE = 2\nSEQUENCE_LENGTH = 8\nINPUT_CHANNELS = 3\nFILTERS = 8\n"
        "NUM_FEATURES = 5\nCHUNK_SIZE = 2"
    ),
    "autodiff_2_per_example_vs_batch.ipynb": (
        "BATCH_SIZE = 16\nINPUT_DIM = 8\nHIDDEN_UNITS = 16\nREPEATS = 1"
    ),
    "autodiff_3_input_vjp_jvp.ipynb": "BATCH_SIZE = 4\nINPUT_DIM = 32\nHIDDEN_UNITS = 16\nREPEATS = 1",
    "autodiff_4_grad_like_torch.ipynb": (
        "BATCH_SIZE = 4\nINPUT_DIM = 16\nHIDDEN_UNITS = 8\nREPEATS = 1"
    ),
    "private_training.ipynb": "EPOCHS = 1\nEPSILONS = [8.0]",
    "data_selection_less.ipynb": "POOL = 64\nTARGETS = 8",
}
# What the last cells print, proving the notebook got to the end and computed something.
EXPECTED_OUTPUT = {
    "quickstart.ipynb": "most influential:",
    "mislabeled_examples.ipynb": "negative-cosine frequency: ROC AUC",
    "explain_a_misprediction.ipynb": "of the top-10 opponents shared",
    # The autodiff notebooks compare keras_gradtrack with the naive version last.
    "autodiff_1_output_feature_gradients.ipynb": "agree: True",
    "autodiff_2_per_example_vs_batch.ipynb": "agree: True",
    "autodiff_3_input_vjp_jvp.ipynb": "agree: True",
    "autodiff_4_grad_like_torch.ipynb": "agree: True",
    "private_training.ipynb": "text: DP-SGD at epsilon",
    "data_selection_less.ipynb": "LESS precision@",
}


@pytest.fixture
def this_python_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A `python3` kernel spec running `sys.executable`, found before any other."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "python3"


def test_every_notebook_is_tested_and_stored_without_outputs():
    assert sorted(path.name for path in NOTEBOOKS.glob("*.ipynb")) == sorted(SMALL_SIZES)
    for name in SMALL_SIZES:
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(notebook)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), name
        assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1, name


# The data-selection notebook's method and numbers are tests/test_data_selection.py's,
# the misprediction notebook's influence and sketches tests/test_attribution.py's, and
# the second to fourth autodiff notebooks' functions tests/test_autodiff.py's (each
# against its own oracle): running them whole is `make test-all`'s.
EXTENDED_NOTEBOOKS = {
    "data_selection_less.ipynb",
    "explain_a_misprediction.ipynb",
    "autodiff_2_per_example_vs_batch.ipynb",
    "autodiff_3_input_vjp_jvp.ipynb",
    "autodiff_4_grad_like_torch.ipynb",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    with_extended(sorted(SMALL_SIZES), EXTENDED_NOTEBOOKS),
)
def test_notebook_runs(name: str, tmp_path: Path, this_python_kernel: str) -> None:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    position = next(
        index
        for index, cell in enumerate(notebook.cells)
        if "parameters" in cell.metadata.get("tags", [])
    )
    notebook.cells.insert(position + 1, nbformat.v4.new_code_cell(SMALL_SIZES[name]))
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=this_python_kernel,
        timeout=int(patience.seconds(3)),
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    printed = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream"
    )
    assert EXPECTED_OUTPUT[name] in printed
