"""graphtrace.explore: exact frames on the fixture report, subgraphs, figures as PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from graphtrace import explore as ex
from graphtrace.report import STALE_VERDICTS, VERDICTS, Report, load_report

FIXTURE = Path(__file__).parent / "data" / "reload_report"
STALE_COLS = [*STALE_VERDICTS, "total", "manifest", "latent", "unknown", "storages", "graphs"]


def _expected(rows: dict, name: str) -> pd.DataFrame:
    return pd.DataFrame(list(rows.values()), columns=STALE_COLS,
                        index=pd.Index(list(rows), dtype=object, name=name), dtype="int64")


#                              stale dang div unref total man lat unk sto gra
@pytest.mark.parametrize("by, rows", [
    ("module", {"layers.1": [2, 2, 1, 0, 5, 1, 2, 2, 3, 2],
                "layers.0": [2, 0, 0, 0, 2, 2, 0, 0, 1, 2]}),
    ("layer", {"layers.1": [2, 2, 1, 0, 5, 1, 2, 2, 3, 2],
               "layers.0": [2, 0, 0, 0, 2, 2, 0, 0, 1, 2]}),
    ("op", {"graphtrace::machete_mm": [2, 2, 1, 0, 5, 1, 2, 2, 3, 2],
            "graphtrace::permute_cols": [2, 0, 0, 0, 2, 2, 0, 0, 1, 2]}),
    ("owner_kind", {"attribute": [4, 2, 1, 0, 7, 3, 2, 2, 4, 2],
                    "buffer": [0, 0, 1, 0, 1, 1, 0, 0, 1, 1]}),
    ("graph", {"decode_bs1": [2, 1, 1, 0, 4, 2, 1, 1, 4, 1],
               "decode_bs8": [2, 1, 0, 0, 3, 1, 1, 1, 3, 1]}),
])
def test_stale_by(report, by, rows):
    pd.testing.assert_frame_equal(ex.stale_by(report, by), _expected(rows, by))


def test_stale_by_empty_and_bad_grouping(report):
    e = report.edges
    clean = Report(edges=e[~e.verdict.isin(STALE_VERDICTS)])
    out = ex.stale_by(clean, "layer")
    assert out.empty and list(out.columns) == STALE_COLS and out.index.name == "layer"
    with pytest.raises(ValueError, match="by must be one of"):
        ex.stale_by(report, "colour")


def test_ownership_by_graph(report):
    cov = ex.ownership_by_graph(report)
    expected = pd.DataFrame({
        "graph_id": [0, 1], "graph": ["decode_bs1", "decode_bs8"],
        "kind": ["emulated", "emulated"], "ops": [5, 2], "accesses": [17, 7],
        "storages": [12, 6], "edges": [12, 6], "owned": [7, 3],
        "owned_fraction": [7 / 12, 0.5], "unowned_internal": [4, 2],
        "unowned_external": [1, 1], "stale": [4, 3], "blind_spots": [1, 1],
    })
    pd.testing.assert_frame_equal(cov, expected, check_dtype=False)
    assert cov["graph_id"].dtype == np.int64 and cov["owned_fraction"].dtype == np.float64
    assert cov["blind_spots"].dtype == np.int64


def test_ownership_by_graph_per_graph_blind_spots_and_empty_graph(report):
    meta = dict(report.meta)
    meta["blind_spots"] = ["global", {"graph": "decode_bs8", "message": "triton kernel"}]
    meta["graphs"] = meta["graphs"] + [{"graph_id": 2, "label": "prefill", "kind": "cuda",
                                        "n_ops": 0, "n_accesses": 0, "thread": "t"}]
    r = Report(report.accesses, report.storages, report.owners, report.edges, meta)
    cov = ex.ownership_by_graph(r).set_index("graph")
    assert cov["blind_spots"].to_dict() == {"decode_bs1": 1, "decode_bs8": 2, "prefill": 1}
    assert cov.loc["prefill", "edges"] == 0 and np.isnan(cov.loc["prefill", "owned_fraction"])


def test_verdicts_per_layer(report):
    pd.testing.assert_frame_equal(ex.verdicts_per_layer(report), report.summary(by="layer"))


def test_read_matrix(report):
    m = ex.read_matrix(report)
    assert list(m.index) == ["decode_bs1", "decode_bs8"]
    assert list(m.columns) == list(range(15))
    assert m.loc["decode_bs1", 2] == "stale" and m.loc["decode_bs8", 4] == "dangling"
    assert m.loc["decode_bs1", 6] == "orphaned" and pd.isna(m.loc["decode_bs8", 0])
    assert int(m.notna().to_numpy().sum()) == 18
    s = ex.read_matrix(report, stale_only=True)
    assert list(s.columns) == [2, 3, 4, 5]
    assert s.loc["decode_bs1"].tolist() == ["stale", "stale", "dangling", "diverged"]
    assert s.loc["decode_bs8"].iloc[:3].tolist() == ["stale", "stale", "dangling"]
    assert pd.isna(s.loc["decode_bs8", 5])


@pytest.mark.parametrize("target, nodes", [
    ("layers.1", {"graph:0", "graph:1", "storage:3", "storage:4", "storage:5",
                  "owner::layers.1.kernel.w_s", "owner::layers.1.kernel.b_q",
                  "owner::layers.1.channel_scales", "owner::layers.1.kernel.extra['ch_s']"}),
    ("layers.0", {"graph:0", "graph:1", "storage:2",
                  "owner::layers.0.kernel.act_perm.keywords['perm']"}),
    ("layers.1.kernel.w_s", {"graph:0", "graph:1", "storage:3", "owner::layers.1.kernel.w_s"}),
    ("layers.1.kernel.extra", {"graph:0", "storage:5", "owner::layers.1.channel_scales",
                               "owner::layers.1.kernel.extra['ch_s']"}),
    ("layers.10", set()),
    ("lm_head", set()),
])
def test_stale_subgraph(report, target, nodes):
    H = ex.stale_subgraph(report, target)
    assert set(H.nodes) == nodes
    assert H is not report.graph and H.is_multigraph()
    for u, v, d in H.edges(data=True):
        if d["relation"] in ("read", "write", "read+write"):
            assert d["stale"] is True


def test_stale_subgraph_all(report):
    H = ex.stale_subgraph(report)
    kinds = pd.Series(dict(H.nodes(data="kind"))).value_counts().to_dict()
    assert kinds == {"graph": 2, "storage": 4, "owner": 5}
    stale = sorted((u, v) for u, v, d in H.edges(data=True) if d.get("stale"))
    assert len(stale) == 7
    # ownership edges come along: 5 at capture, 1 still held (the diverged buffer)
    rel = pd.Series([k for _, _, k in H.edges(keys=True)]).value_counts().to_dict()
    assert rel["owned_at_capture"] == 5 and rel["owns_now"] == 1


def _check_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.stat().st_size > 2000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    # more than a blank canvas: many distinct colours
    assert len(np.unique(img.reshape(-1, img.shape[2]), axis=0)) > 20


@pytest.mark.parametrize("draw", [
    lambda r: ex.plot_verdicts_per_layer(r),
    lambda r: ex.draw_stale_subgraph(r),
    lambda r: ex.draw_stale_subgraph(r, "layers.1"),
    lambda r: ex.plot_read_matrix(r),
    lambda r: ex.plot_read_matrix(r, stale_only=True),
], ids=["verdicts_per_layer", "stale_subgraph", "stale_subgraph_layer", "read_matrix",
        "read_matrix_stale"])
def test_figures_render_to_png(report, tmp_path, draw):
    from matplotlib.figure import Figure

    fig = draw(report)
    assert isinstance(fig, Figure)
    out = tmp_path / "fig.png"
    fig.savefig(out, dpi=72)
    _check_png(out)


def test_figures_on_empty_report_and_given_axes(tmp_path):
    from matplotlib.figure import Figure

    empty = Report()
    for fig in (ex.plot_verdicts_per_layer(empty), ex.draw_stale_subgraph(empty),
                ex.plot_read_matrix(empty)):
        fig.savefig(tmp_path / "e.png")
        assert (tmp_path / "e.png").stat().st_size > 0
    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    rep = load_report(FIXTURE)
    assert ex.plot_verdicts_per_layer(rep, ax=ax1) is fig
    assert ex.plot_read_matrix(rep, ax=ax2) is fig


def test_verdict_colors_cover_every_verdict():
    assert set(ex.VERDICT_COLORS) == set(VERDICTS)


def test_repeated_graph_labels_stay_apart(report):
    acc = report.accesses.assign(graph="decode")
    edges = report.edges.assign(graph="decode")
    r = Report(acc, report.storages, report.owners, edges)
    m = ex.read_matrix(r)
    assert list(m.index) == ["decode#0", "decode#1"]
    assert m.loc["decode#1", 4] == "dangling" and pd.isna(m.loc["decode#1", 0])
    assert list(r.summary(by="graph").index) == ["decode#0", "decode#1"]
    assert ex.stale_by(r, "graph")["total"].to_dict() == {"decode#0": 4, "decode#1": 3}
