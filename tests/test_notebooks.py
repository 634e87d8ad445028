"""The evaluation notebooks run top to bottom (nbclient, the tiny preset) and are committed without outputs."""

import json
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist_and_carry_no_outputs():
    assert [p.stem for p in NOTEBOOKS] == ["evaluate", "learning_curves", "sft_vs_rl"]
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("VLA_RL_NOTEBOOK_DIR", str(tmp_path / "runs"))
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(Path(__file__).resolve().parents[1])}})
    start = time.perf_counter()
    client.execute()   # raises CellExecutionError with the failing cell's traceback
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # every notebook shows a figure or a video (an image output) and a table
    assert any("image/png" in o.get("data", {}) or "image/gif" in o.get("data", {}) for o in outputs)
    assert any("text/markdown" in o.get("data", {}) or "text/plain" in o.get("data", {}) for o in outputs)
    print(f"{path.name}: {time.perf_counter() - start:.0f} s")
