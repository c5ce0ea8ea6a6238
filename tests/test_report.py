"""Report frames, files, graph and the test-suite check, on the hand-made fixture folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from graphtrace.report import (
    FORMAT_VERSION,
    SCHEMA,
    STALE_VERDICTS,
    VERDICTS,
    Report,
    ReportError,
    assert_no_stale,
    layer_of,
    load_report,
    read_graphml,
)

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "reload_report"
REPO = Path(__file__).resolve().parents[1]
FRAMES = ("accesses", "storages", "owners", "edges")

PERM = "layers.0.kernel.act_perm.keywords['perm']"


def assert_reports_equal(a: Report, b: Report) -> None:
    for name in FRAMES:
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), obj=name)
    assert a.meta == b.meta
    assert_graphs_equal(a.graph, b.graph)


def assert_graphs_equal(g, h) -> None:
    assert type(g) is type(h)
    assert dict(g.nodes(data=True)) == dict(h.nodes(data=True))
    ge = sorted((u, v, k, sorted(d.items())) for u, v, k, d in g.edges(keys=True, data=True))
    he = sorted((u, v, k, sorted(d.items())) for u, v, k, d in h.edges(keys=True, data=True))
    assert ge == he


def copy_fixture(tmp_path: Path) -> Path:
    dst = tmp_path / "rep"
    shutil.copytree(FIXTURE, dst)
    return dst


# --------------------------------------------------------------------------- frames

def test_fixture_frames_have_documented_columns_and_dtypes(report):
    for name in FRAMES:
        df = getattr(report, name)
        assert list(df.columns) == [c for c, _ in SCHEMA[name]]
        assert isinstance(df.index, pd.RangeIndex)
    assert (len(report.accesses), len(report.storages), len(report.owners),
            len(report.edges)) == (24, 15, 9, 18)
    e = report.edges
    assert e["graph_id"].dtype == np.int64 and e["n_owners"].dtype == np.int64
    assert e["live_data_ptr"].dtype == "Int64"
    assert report.storages["alive"].dtype == bool
    # "" is kept where it means unknown / no owner; NA where the contract says so.
    assert (e.loc[e.verdict == "unowned", "owners"] == "").all()
    assert e.loc[e.verdict == "unowned", "impact"].isna().all()
    assert e.loc[e.verdict == "stable", "origin"].isna().all()
    assert report.owners["model"].eq("").all()
    assert report.owners["live_data_ptr"].isna().sum() == 1


def test_stale_rows(report):
    stale = report.stale
    # the fixture predates freshness: every stale-like verdict but unrefreshed
    assert sorted(stale.verdict.unique()) == sorted(set(STALE_VERDICTS) - {"unrefreshed"})
    assert len(stale) == 7
    assert sorted(zip(stale.graph_id, stale.storage_id)) == [
        (0, 2), (0, 3), (0, 4), (0, 5), (1, 2), (1, 3), (1, 4)]
    # index kept: rows can be found in edges
    pd.testing.assert_frame_equal(report.edges.loc[stale.index], stale)


def test_meta_errors_blind_spots_graphs(report):
    assert report.meta["torch_version"] == "2.13.0+cpu"
    assert report.errors == [{"where": "recorder.dispatch", "traceback": "",
                              "message": "could not classify argument 'schedule' of "
                                         "graphtrace::machete_mm"}]
    assert report.blind_spots == [
        "Inductor Triton kernels launch without the dispatcher: none recorded in this run"]
    g = report.graphs
    assert g.to_dict("records") == [
        {"graph_id": 0, "label": "decode_bs1", "kind": "emulated", "n_ops": 5,
         "n_accesses": 17, "thread": "MainThread"},
        {"graph_id": 1, "label": "decode_bs8", "kind": "emulated", "n_ops": 2,
         "n_accesses": 7, "thread": "MainThread"}]


def test_graphs_derived_without_meta(report):
    r = Report(report.accesses, report.storages, report.owners, report.edges)
    assert r.graphs[["graph_id", "label", "n_ops", "n_accesses"]].to_dict("records") == [
        {"graph_id": 0, "label": "decode_bs1", "n_ops": 5, "n_accesses": 17},
        {"graph_id": 1, "label": "decode_bs8", "n_ops": 2, "n_accesses": 7}]
    assert r.errors == [] and r.blind_spots == [] and r.meta == {}


# --------------------------------------------------------------------------- summary

def test_summary_counts(report):
    s = report.summary()
    expected = pd.DataFrame(
        {"edges": [2, 4, 2, 1, 1, 8, 0], "storages": [2, 2, 1, 1, 1, 8, 0],
         "graphs": [1, 2, 2, 1, 1, 2, 0], "manifest": [0, 2, 0, 1, 0, 0, 0],
         "latent": [0, 2, 0, 0, 0, 0, 0], "unknown": [0, 0, 2, 0, 0, 0, 0]},
        index=pd.Index(list(VERDICTS), dtype=object, name="verdict"), dtype="int64")
    pd.testing.assert_frame_equal(s, expected)
    assert report.counts() == {"stable": 2, "stale": 4, "dangling": 2, "diverged": 1,
                               "orphaned": 1, "unowned": 8, "unrefreshed": 0}


def _crosstab(rows: dict, name: str) -> pd.DataFrame:
    cols = [*VERDICTS, "total"]
    data = [[*v, sum(v)] for v in rows.values()]
    return pd.DataFrame(data, columns=pd.Index(cols, dtype=object),
                        index=pd.Index(list(rows), dtype=object, name=name), dtype="int64")


@pytest.mark.parametrize("by, rows", [
    ("owner_kind", {"(none)": [0, 0, 0, 0, 0, 8, 0], "attribute": [0, 4, 2, 1, 1, 0, 0],
                    "buffer": [0, 0, 0, 1, 0, 0, 0], "parameter": [2, 0, 0, 0, 0, 0, 0]}),
    ("op", {"aten::mm": [1, 0, 0, 0, 0, 2, 0], "graphtrace::machete_mm": [1, 2, 2, 1, 1, 5, 0],
            "graphtrace::permute_cols": [0, 2, 0, 0, 0, 4, 0]}),
    ("module", {"layers.0": [1, 2, 0, 0, 1, 5, 0], "layers.1": [0, 2, 2, 1, 0, 2, 0],
                "lm_head": [1, 0, 0, 0, 0, 1, 0]}),
    ("layer", {"(none)": [1, 0, 0, 0, 0, 1, 0], "layers.0": [1, 2, 0, 0, 1, 5, 0],
               "layers.1": [0, 2, 2, 1, 0, 2, 0]}),
    ("graph", {"decode_bs1": [2, 2, 1, 1, 1, 5, 0], "decode_bs8": [0, 2, 1, 0, 0, 3, 0]}),
])
def test_summary_by(report, by, rows):
    pd.testing.assert_frame_equal(report.summary(by=by), _crosstab(rows, by))


def test_summary_by_rejects_unknown_grouping(report):
    with pytest.raises(ValueError, match="by must be one of"):
        report.summary(by="colour")


@pytest.mark.parametrize("path, layer", [
    ("model.layers.3.mlp.down_proj", "layers.3"), ("layers.12", "layers.12"),
    ("layers.0.kernel.act_perm.keywords['perm']", "layers.0"), ("transformer.h.7.attn", "h.7"),
    ("lm_head", ""), ("", ""), (None, ""), ("mylayers.2", ""), ("layers.2x", ""),
])
def test_layer_of(path, layer):
    assert layer_of(path) == layer


# --------------------------------------------------------------------------- graph

def test_graph_nodes_and_edges(report):
    G = report.graph
    assert G.is_directed() and G.is_multigraph()
    kinds = pd.Series(dict(G.nodes(data="kind"))).value_counts().to_dict()
    assert kinds == {"graph": 2, "storage": 15, "owner": 9}
    assert G.nodes["graph:1"] == {"kind": "graph", "graph_id": 1, "label": "decode_bs8",
                                  "capture": "emulated", "n_accesses": 7}
    assert G.nodes["storage:4"] == {
        "kind": "storage", "storage_id": 4, "data_ptr": 0x7F3A00004000, "nbytes": 256,
        "device": "cpu", "alive": False, "first_access": "read", "stale": True}
    assert G.nodes[f"owner::{PERM}"] == {"kind": "owner", "model": "", "path": PERM,
                                         "owner_kind": "attribute", "status": "moved"}
    rel = pd.Series([k for _, _, k in G.edges(keys=True)]).value_counts().to_dict()
    assert rel == {"read": 12, "read+write": 4, "write": 2, "owned_at_capture": 9,
                   "owns_now": 4}
    # reads point from the graph to the storage and carry the verdict
    d = G.get_edge_data("graph:0", "storage:2", key="read")
    assert d["relation"] == "read" and d["verdict"] == "stale" and d["impact"] == "manifest"
    assert d["stale"] is True and d["ops"] == "graphtrace::permute_cols"
    assert G.get_edge_data("storage:2", "graph:0") is None
    stale_edges = sorted((u, v, d["verdict"]) for u, v, d in G.edges(data=True) if d.get("stale"))
    assert stale_edges == [
        ("graph:0", "storage:2", "stale"), ("graph:0", "storage:3", "stale"),
        ("graph:0", "storage:4", "dangling"), ("graph:0", "storage:5", "diverged"),
        ("graph:1", "storage:2", "stale"), ("graph:1", "storage:3", "stale"),
        ("graph:1", "storage:4", "dangling")]
    assert G.get_edge_data("graph:0", "storage:0", key="read")["stale"] is False
    assert G.get_edge_data("graph:0", "storage:7", key="read")["origin"] == "external"
    # ownership: at capture for everyone, now only where the owner still holds it
    assert set(G["owner::layers.1.channel_scales"]["storage:5"]) == {"owned_at_capture",
                                                                      "owns_now"}
    assert set(G["owner::layers.1.kernel.extra['ch_s']"]["storage:5"]) == {"owned_at_capture"}
    assert G["owner::layers.0.cfg.scales"]["storage:6"]["owned_at_capture"] == {
        "relation": "owned_at_capture", "status": "orphaned"}
    moved = G["owner::layers.1.kernel.b_q"]["storage:4"]["owned_at_capture"]
    assert moved["live_data_ptr"] == G.nodes["storage:4"]["data_ptr"]  # address reused
    assert sorted(G.predecessors("storage:5")) == [
        "graph:0", "owner::layers.1.channel_scales", "owner::layers.1.kernel.extra['ch_s']"]
    assert report.graph is G  # built once


def test_fixture_graphml_matches_rebuilt_graph(report):
    assert_graphs_equal(read_graphml(FIXTURE), report.graph)


# --------------------------------------------------------------------------- files

def test_round_trip_fixture(report, tmp_path):
    out = report.to_csv(tmp_path / "a" / "b")  # parents created
    assert out == tmp_path / "a" / "b"
    assert sorted(p.name for p in out.iterdir()) == [
        "accesses.csv", "edges.csv", "graph.graphml", "manifest.json", "owners.csv",
        "storages.csv"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "graphtrace-report"
    assert manifest["format_version"] == FORMAT_VERSION == 1
    assert manifest["graphtrace_version"] == "0.1.0"
    assert manifest["torch_version"] == "2.13.0+cpu"
    assert manifest["created"] == "2026-11-30T10:00:00+00:00"
    assert manifest["meta"] == report.meta
    back = load_report(out)
    assert_reports_equal(report, back)
    assert_graphs_equal(read_graphml(out / "graph.graphml"), report.graph)
    assert back.source == out and back.manifest == manifest
    assert Report().source is None and Report().manifest == {}
    # Report.load is what load_report calls; a subclass loads as itself
    class Sub(Report):
        pass
    loaded = Sub.load(str(out))
    assert type(loaded) is Sub and type(Report.load(out)) is Report
    assert_reports_equal(back, loaded)
    assert loaded.source == out and loaded.manifest == manifest
    # a second write over the same folder is fine
    report.to_csv(out)
    assert_reports_equal(report, load_report(out))


def _messy_frames(report: Report) -> dict:
    """The fixture's frames the way a producer might hand them over: categoricals with
    unused and unsorted categories, object strings with None, floats for ints, a shuffled
    column order, a non-range index, pointers above 2**53, and extra columns."""
    acc = report.accesses.astype(object).copy()
    for c in ("graph", "op", "module", "arg", "access", "dtype", "device"):
        cats = sorted(set(acc[c]) | {"zzz_unused"}, reverse=True)
        acc[c] = pd.Categorical(acc[c], categories=cats)
    acc["module"] = acc["module"].cat.add_categories([]).astype(object).where(
        acc["module"] != "lm_head", None).astype("category")  # NA -> "" (unknown)
    acc = acc[list(reversed(acc.columns))]
    acc.index = acc.index * 10 + 5
    acc["seq"] = acc["seq"].astype(float)
    sto = report.storages.copy()
    sto.loc[0, "data_ptr"] = 2**62 + 1
    sto["alive"] = sto["alive"].astype(object)
    sto["note"] = ["x"] * (len(sto) - 1) + [None]      # extra string column with NA
    sto["score"] = np.linspace(0.1, 1.5, len(sto))      # extra float column
    own = report.owners.copy()
    own["live_data_ptr"] = own["live_data_ptr"].astype(object).where(
        own["live_data_ptr"].notna(), None)
    own.loc[0, "live_data_ptr"] = 2**63 - 1
    edg = report.edges.copy()
    edg["verdict"] = edg["verdict"].astype("category")
    edg["impact"] = edg["impact"].astype(object).where(edg["impact"].notna(), None)
    edg["origin"] = edg["origin"].fillna("")              # "" means NA here
    edg["hot"] = edg["verdict"].astype(str) == "stale"   # extra bool column
    edg["rank"] = pd.array(range(len(edg)), dtype="Int64")
    edg.loc[0, "rank"] = pd.NA
    return {"accesses": acc, "storages": sto, "owners": own, "edges": edg}


def test_round_trip_messy_frames_is_exact(report, tmp_path):
    f = _messy_frames(report)
    meta = dict(report.meta, extra=(1, np.int64(2)), path=Path("/x"))
    r = Report.from_frames(**f, meta=meta)
    # canonical form in memory
    acc = r.accesses
    assert list(acc.columns) == [c for c, _ in SCHEMA["accesses"]]
    assert isinstance(acc.index, pd.RangeIndex)
    assert isinstance(acc["op"].dtype, pd.CategoricalDtype)
    assert list(acc["op"].cat.categories) == sorted(set(acc["op"]))
    assert acc.loc[acc.op == "aten::mm", "module"].eq("").all()
    assert acc["seq"].dtype == np.int64
    assert r.storages.at[0, "data_ptr"] == 2**62 + 1
    assert r.owners.at[0, "live_data_ptr"] == 2**63 - 1
    assert r.edges["origin"].isna().sum() == 10
    assert r.meta["extra"] == [1, 2] and r.meta["path"] == "/x"
    assert list(r.storages.columns[-2:]) == ["note", "score"]
    back = load_report(r.to_csv(tmp_path / "messy"))
    assert_reports_equal(r, back)
    assert back.storages["score"].tolist() == r.storages["score"].tolist()  # floats exact
    assert back.edges["rank"].dtype == "Int64" and back.edges["hot"].dtype == bool


def test_round_trip_empty_report(tmp_path):
    r = Report()
    assert all(len(getattr(r, n)) == 0 for n in FRAMES)
    assert r.summary()["edges"].sum() == 0
    assert r.graph.number_of_nodes() == 0
    back = load_report(r.to_csv(tmp_path / "empty"))
    assert_reports_equal(r, back)
    assert "no edges" in repr(back)


def test_load_report_is_torch_free(tmp_path):
    code = f"""
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any import of torch now fails
import graphtrace.report as rep, graphtrace.explore as ex, graphtrace.cli as cli
subs = [m.name for m in pkgutil.iter_modules(rep.__path__, "graphtrace.report.")]
assert {{"graphtrace.report.core", "graphtrace.report.io"}} <= set(subs), subs
for name in subs:
    importlib.import_module(name)
r = rep.load_report({str(FIXTURE)!r})
assert r.counts()["stale"] == 4, r.counts()
r.graph; r.summary(by="layer"); ex.ownership_by_graph(r); ex.stale_by(r, "op")
back = rep.load_report(r.to_csv({str(tmp_path / 'out')!r}))
assert len(back.edges) == 18
assert cli.main(["report", {str(FIXTURE)!r}]) == 0
assert sys.modules["torch"] is None
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("ok")


# --------------------------------------------------------------------------- the atomic swap

@pytest.mark.parametrize("graphml", [True, False])
def test_rewriting_a_folder_moves_the_manifest_out_first_and_in_last(report, tmp_path,
                                                                     monkeypatch, graphml):
    """Note [What a report folder guarantees]: while an existing report folder is replaced,
    a reader that finds a manifest finds the report it names, whole (the old one or the new
    one, never new CSVs under the old manifest or the new manifest over missing files). The
    folder is read after every single move of the swap."""
    import graphtrace.report.io as report_io

    out = report.to_csv(tmp_path / "out", graphml=True)
    (out / "notes.txt").write_text("mine")
    new = Report.from_frames(report.accesses, report.storages, report.owners,
                             report.edges.iloc[:5], dict(report.meta, models=["other"]))
    real = os.replace
    moves: list[tuple[str, str]] = []  # ("in" | "out", file name) of each move of the swap
    seen: list[str] = []  # what a reader found after each move: "old", "new" or "none"

    def replace(src, dst):
        real(src, dst)
        src, dst = Path(src), Path(dst)
        if dst.parent == out:
            moves.append(("in", dst.name))
        elif src.parent == out:
            moves.append(("out", src.name))
        if not (out / "manifest.json").exists():
            seen.append("none")
            return
        found = load_report(out)  # a ReportError here: a manifest over the wrong files
        seen.append("new" if len(found.edges) == len(new.edges) else "old")
        assert_reports_equal(found, new if seen[-1] == "new" else report)

    monkeypatch.setattr(report_io.os, "replace", replace)
    new.to_csv(out, graphml=graphml)
    monkeypatch.undo()
    names = [*(f"{n}.csv" for n in FRAMES), *(["graph.graphml"] if graphml else []),
             "manifest.json"]
    outs = [name for way, name in moves if way == "out"]
    ins = [name for way, name in moves if way == "in"]
    assert outs[0] == "manifest.json" and sorted(outs) == sorted(
        [*(f"{n}.csv" for n in FRAMES), "graph.graphml", "manifest.json"])
    assert ins[-1] == "manifest.json" and sorted(ins) == sorted(names)
    assert moves.index(("in", ins[0])) > moves.index(("out", outs[-1]))  # old all out first
    assert seen[0] == "none" and seen[-1] == "new" and "old" not in seen  # the old manifest
    assert seen.count("new") == 1  # went first; the new one came last
    assert (out / "notes.txt").read_text() == "mine"
    assert_reports_equal(load_report(out), new)


# --------------------------------------------------------------------------- bad folders

def _write_manifest(folder: Path, obj) -> None:
    (folder / "manifest.json").write_text(json.dumps(obj))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.mark.parametrize("case, pattern", [
    ("missing", "no such report folder"),
    ("file", "not a folder"),
    ("no_manifest", r"not a graphtrace report \(no manifest.json\)"),
    ("bad_json", "unreadable manifest"),
    ("foreign", "not a graphtrace report manifest .*format='other-tool'"),
    ("list", "not a graphtrace report manifest"),
    ("version", "unsupported format_version 2 .*reads 1"),
    ("no_version", "unsupported format_version None"),
    ("missing_csv", "incomplete report: missing owners.csv, edges.csv"),
    ("missing_column", r"owners.csv: missing columns: status, live_data_ptr"),
    ("bad_value", r"storages.csv: column nbytes, row 0 \(line 2\): cannot read 'lots' as int"),
    ("empty_csv", r"accesses.csv: unreadable CSV"),
    ("bad_verdict", r"edges.csv: column verdict, row 3 \(line 5\): unknown value 'fresh' "
                    r"\(verdicts are stable, "),
])
@pytest.mark.parametrize("load", [load_report, Report.load], ids=["load_report", "Report.load"])
def test_load_report_errors(tmp_path, case, pattern, load):
    folder = copy_fixture(tmp_path)
    if case == "missing":
        folder = tmp_path / "nope"
    elif case == "file":
        folder = tmp_path / "file.txt"
        folder.write_text("hi")
    elif case == "no_manifest":
        (folder / "manifest.json").unlink()
    elif case == "bad_json":
        (folder / "manifest.json").write_text("{not json")
    elif case == "foreign":
        _write_manifest(folder, {"format": "other-tool", "format_version": 1})
    elif case == "list":
        _write_manifest(folder, [1, 2])
    elif case == "version":
        _write_manifest(folder, dict(_manifest(folder), format_version=2))
    elif case == "no_version":
        m = _manifest(folder)
        del m["format_version"]
        _write_manifest(folder, m)
    elif case == "missing_csv":
        (folder / "edges.csv").unlink()
        (folder / "owners.csv").unlink()
    elif case == "missing_column":
        df = pd.read_csv(folder / "owners.csv", dtype=str, keep_default_na=False)
        df.drop(columns=["status", "live_data_ptr"]).to_csv(folder / "owners.csv", index=False)
    elif case == "bad_value":
        text = (folder / "storages.csv").read_text().replace(",2048,", ",lots,")
        (folder / "storages.csv").write_text(text)
    elif case == "empty_csv":
        (folder / "accesses.csv").write_text("")
    elif case == "bad_verdict":
        text = (folder / "edges.csv").read_text().replace(",stable,", ",fresh,", 1)
        (folder / "edges.csv").write_text(text)
    with pytest.raises(ReportError, match=pattern) as info:
        load(folder)
    assert isinstance(info.value, ValueError)
    assert str(folder) in str(info.value) or case in ("missing_csv",)
    assert "\n" not in str(info.value)


def test_from_frames_validation(report):
    with pytest.raises(ReportError, match=r"edges: missing columns: verdict, impact"):
        Report.from_frames(edges=report.edges.drop(columns=["verdict", "impact"]))
    with pytest.raises(ReportError, match="accesses: expected a pandas DataFrame"):
        Report.from_frames(accesses=[1, 2])
    with pytest.raises(ReportError, match="storages.alive, row 0: missing value"):
        Report.from_frames(storages=report.storages.assign(
            alive=[None] + [True] * (len(report.storages) - 1)))
    with pytest.raises(ReportError, match="owners.storage_id, row 0: missing value"):
        Report.from_frames(owners=report.owners.assign(
            storage_id=[np.nan] + [1.0] * (len(report.owners) - 1)))
    with pytest.raises(ReportError, match="meta: expected a dict"):
        Report.from_frames(meta=["x"])


# --------------------------------------------------------------------------- display

def test_repr(report):
    text = repr(report)
    assert text == ("<graphtrace Report: 2 graphs, 18 edges, 7 stale-like, 1 error, "
                    "1 blind spot; stable=2 stale=4 dangling=2 diverged=1 orphaned=1 "
                    "unowned=8>")
    html = report._repr_html_()
    assert html.startswith("<div>") and "<table>" in html
    assert html.count("<tr") == 8  # header + seven verdicts
    assert "<td>dangling</td><td>2</td>" in html


# --------------------------------------------------------------------------- assert_no_stale

def test_assert_no_stale_lists_every_stale_edge(report):
    with pytest.raises(AssertionError) as info:
        assert_no_stale(report)
    msg = str(info.value)
    lines = msg.splitlines()
    assert lines[0] == ("7 stale-like edges after reload (4 stale, 2 dangling, 1 diverged) "
                        "in 2 graphs:")
    assert len(lines) == 1 + 7 + 1
    assert (f"  - graph 'decode_bs1' storage 2: stale (manifest); ops graphtrace::permute_cols;"
            f" owners {PERM} (attribute, moved)") in lines
    assert ("  - graph 'decode_bs8' storage 4: dangling (unknown); ops graphtrace::machete_mm;"
            " owners layers.1.kernel.b_q (attribute, moved)") in lines
    assert ("owners layers.1.channel_scales (buffer, holds); layers.1.kernel.extra['ch_s'] "
            "(attribute, moved)") in msg
    assert "stale (latent)" in msg
    assert "orphaned" not in msg and "storage 0:" not in msg
    assert "allow=" in lines[-1]


def test_assert_no_stale_allow(report):
    with pytest.raises(AssertionError, match=r"^3 stale-like edges .*\(2 dangling, 1 diverged\)"):
        assert_no_stale(report, allow=("stale",))
    with pytest.raises(AssertionError, match=r"^1 stale-like edge after reload \(1 diverged\) "
                                             r"in 1 graph:"):
        report.check(allow=["stale", "dangling"])
    assert_no_stale(report, allow=STALE_VERDICTS)
    # owner path globs; brackets match literally too; all owners of an edge must match
    with pytest.raises(AssertionError) as info:
        assert_no_stale(report, allow=("layers.*.kernel.*",))
    assert str(info.value).startswith("1 stale-like edge")  # diverged: its buffer owner
    assert_no_stale(report, allow=("layers.*.kernel.*", "layers.1.channel_scales"))
    assert_no_stale(report, allow=(PERM, "layers.1.kernel.[bw]_*", "diverged"))
    with pytest.raises(AssertionError, match="^2 stale-like edges"):
        assert_no_stale(report, allow="layers.1.*")  # a single string is one glob


def test_assert_no_stale_passes_on_a_clean_report(report):
    e = report.edges
    clean = Report(report.accesses, report.storages, report.owners,
                   e[~e.verdict.isin(STALE_VERDICTS)], report.meta)
    assert_no_stale(clean)
    clean.check()
    assert len(clean.stale) == 0


# --------------------------------------------------------------------------- public surface

def _private_report_imports(path: Path) -> list[str]:
    """The private names a module takes from graphtrace.report: ``from graphtrace.report[.x]
    import _name``, and ``alias._name`` where ``alias`` is bound to graphtrace.report[.x]."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    bad, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphtrace.report"):
            bad += [a.name for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.ImportFrom) and node.module == "graphtrace":
            aliases.update(a.asname or a.name for a in node.names if a.name == "report")
        elif isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names
                           if a.asname and a.name.startswith("graphtrace.report"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and node.attr.startswith("_"):
            bad.append(node.attr)
    return bad


def test_private_report_imports_are_found(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("from graphtrace.report import Report, _is_na\n"
                   "from graphtrace.report.core import _x\n"
                   "import graphtrace.report.io as rio\nrio._fail\n"
                   "from graphtrace import report as r\nr._y, r.Report\n")
    assert sorted(_private_report_imports(mod)) == ["_fail", "_is_na", "_x", "_y"]


def test_report_public_surface():
    import graphtrace
    import graphtrace.report as rep

    for name in rep.__all__:
        value = getattr(rep, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    assert not [n for n in rep.__all__ if n.startswith("_")]
    for name in ("Report", "ReportError", "load_report", "assert_no_stale", "VERDICTS",
                 "STALE_VERDICTS"):
        assert getattr(graphtrace, name) is getattr(rep, name)
    # every module outside the package uses only its public names
    users = [p for p in (REPO / "graphtrace").rglob("*.py") if "report" not in p.parent.name]
    users += list((REPO / "analysis").glob("*.py"))
    found = {str(p.relative_to(REPO)): _private_report_imports(p) for p in users}
    assert {k: v for k, v in found.items() if v} == {}

