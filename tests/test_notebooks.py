"""The notebooks in notebooks/: stored clean, executed headless on a fresh demo report.

One ``graphtrace demo`` run per session (CPU, the three variants the notebooks compare)
feeds every notebook through ``GRAPHTRACE_REPORT_DIR``. Notebooks run in a kernel whose
kernelspec (``python3``, written to a temporary ``JUPYTER_PATH``) starts this interpreter,
so they see the same environment as the tests. A failing cell raises
``CellExecutionError``, which fails the test with the cell's traceback.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
DEMO_VARIANTS = ("unfixed-partial", "rejected-fix", "fixed")
CELL_TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT_CALL = re.compile(r"\b(plot_\w+|draw_\w+)\(")


def _ids(paths):
    return [p.name for p in paths]


# --------------------------------------------------------------------------- stored form

def test_notebooks_exist():
    assert "stale_reads.ipynb" in _ids(NOTEBOOKS)


def test_notebook_folder_holds_no_data():
    """Only notebooks (and prose) are committed there: reports are made during the run."""
    extra = [p.relative_to(NOTEBOOK_DIR).as_posix() for p in NOTEBOOK_DIR.rglob("*")
             if p.is_file() and not any(part.startswith(".")
                                         for part in p.relative_to(NOTEBOOK_DIR).parts)
             and p.suffix not in (".ipynb", ".md")]
    assert not extra, f"data files in notebooks/: {extra}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_stored_without_outputs(path):
    """Saved clean: a notebook committed with outputs, counts or run metadata fails."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "widgets" not in nb["metadata"]
    dirty = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            if cell.get("outputs") or cell.get("execution_count") is not None:
                dirty.append(f"cell {i}: outputs or execution_count")
            if "execution" in cell.get("metadata", {}):
                dirty.append(f"cell {i}: execution timing metadata")
        if cell.get("attachments"):
            dirty.append(f"cell {i}: attachments")
    assert not dirty, f"{path.name} was saved with outputs (clear them): {dirty}"
    assert path.stat().st_size < 64_000, f"{path.name} is suspiciously large"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_is_valid_nbformat(path):
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.read(path, as_version=4))


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """``graphtrace demo`` once per session, on the CPU, for the variants the notebooks use."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("demo")
    cmd = [sys.executable, "-m", "graphtrace.demo", "--device", "cpu", "--quiet",
           "--out", str(out)]
    for v in DEMO_VARIANTS:
        cmd += ["--variant", v]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    for v in DEMO_VARIANTS:
        for s in ("new-weights", "same-weights"):
            assert (out / v / s / "manifest.json").is_file()
    return out


@pytest.fixture
def kernel_env(tmp_path, monkeypatch, demo_dir) -> Path:
    """A ``python3`` kernelspec running this interpreter, found first through JUPYTER_PATH;
    Jupyter and IPython state kept in tmp_path; the demo folder passed to the kernel; this
    checkout first on the kernel's path (as pytest's ``pythonpath``), not an installed copy."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (graphtrace tests)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("GRAPHTRACE_REPORT_DIR", str(demo_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    return work


# --------------------------------------------------------------------------- execution

def _png_bytes(output) -> bytes | None:
    data = output.get("data", {}) if output.get("output_type") in (
        "display_data", "execute_result") else {}
    return base64.b64decode(data["image/png"]) if "image/png" in data else None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_executes(path, kernel_env, demo_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")

    nb = nbformat.read(path, as_version=4)
    plot_cells = sum(1 for c in nb.cells
                     if c.cell_type == "code" and PLOT_CALL.search(c.source))
    # A probe, run after the notebook's own cells: which interpreter and report folder.
    nb.cells.append(nbformat.v4.new_code_cell(
        "import os, sys, graphtrace\nprint(sys.executable)\n"
        "print(os.environ['GRAPHTRACE_REPORT_DIR'])\nprint(graphtrace.__file__)"))
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=60,
        resources={"metadata": {"path": str(kernel_env)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs).split("\n")
    assert Path(probe[0]).resolve() == Path(sys.executable).resolve()
    assert probe[1] == str(demo_dir)
    assert Path(probe[2]).resolve().parent == ROOT / "graphtrace"  # the checkout under test

    # Every cell that calls a plot helper shows its figure, as a real PNG.
    pngs = [b for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if (b := _png_bytes(o)) is not None]
    assert len(pngs) >= plot_cells, (
        f"{plot_cells} plot cells but {len(pngs)} PNG outputs: figures not rendered")
    for png in pngs:
        assert png.startswith(PNG_MAGIC) and len(png) > 2_000


# --------------------------------------------------------------------------- figures

def _render(fig) -> "np.ndarray":  # noqa: F821
    import matplotlib.image as mimg

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    png = buf.getvalue()
    assert png.startswith(PNG_MAGIC) and len(png) > 2_000
    img = mimg.imread(io.BytesIO(png), format="png")
    w, h = fig.get_size_inches() * 80
    assert img.shape[:2] == (round(h), round(w))
    assert img[..., :3].std() > 0.01, "blank figure"
    return img


def _pixels(img, hex_color: str, tol: float = 0.03) -> int:
    """How many pixels have (nearly) this colour."""
    import numpy as np
    from matplotlib.colors import to_rgb

    rgb = np.array(to_rgb(hex_color))
    return int((np.abs(img[..., :3] - rgb) < tol).all(axis=-1).sum())


@pytest.fixture(scope="module")
def demo_reports(demo_dir):
    from graphtrace import load_report

    return {v: load_report(demo_dir / v / "new-weights") for v in DEMO_VARIANTS}


HELPERS = {
    "verdicts_per_layer": lambda ex, r: ex.plot_verdicts_per_layer(r),
    "stale_subgraph": lambda ex, r: ex.draw_stale_subgraph(r, "layers.0"),
    "read_matrix": lambda ex, r: ex.plot_read_matrix(r),
}


@pytest.mark.parametrize("helper", list(HELPERS))
def test_demo_figures_render_to_png(demo_reports, helper):
    """The plot helpers on real demo reports: non-empty PNGs that show the verdicts found
    (red stale reads for the bug, orange diverged for the rejected fix, neither for the fix)."""
    pytest.importorskip("matplotlib")
    from graphtrace import explore as ex

    colors = ex.VERDICT_COLORS
    img = {v: _render(HELPERS[helper](ex, r)) for v, r in demo_reports.items()}
    assert _pixels(img["unfixed-partial"], colors["stale"]) > 20
    assert _pixels(img["rejected-fix"], colors["diverged"]) > 20
    for verdict in ("stale", "dangling", "diverged"):
        assert _pixels(img["fixed"], colors[verdict]) == 0, verdict
    if helper != "stale_subgraph":  # its legend always shows every stale-like colour
        assert _pixels(img["rejected-fix"], colors["stale"]) == 0
        assert _pixels(img["unfixed-partial"], colors["diverged"]) == 0
    else:  # red arrows for the bug; only the legend's red line for the rejected fix
        assert (_pixels(img["unfixed-partial"], colors["stale"])
                > 3 * _pixels(img["rejected-fix"], colors["stale"]))
    for v in DEMO_VARIANTS:  # stable reads show as green everywhere but in the subgraph
        if helper != "stale_subgraph":
            assert _pixels(img[v], colors["stable"]) > 20
