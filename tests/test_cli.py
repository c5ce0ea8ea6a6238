"""``graphtrace`` CLI: the terminal report on the fixture folder, --csv/--json, errors, demo."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

import graphtrace
from graphtrace.cli import format_report, main
from graphtrace.report import STALE_VERDICTS, Report, load_report

FIXTURE = Path(__file__).parent / "data" / "reload_report"
REPO = Path(__file__).resolve().parents[1]
PERM = "layers.0.kernel.act_perm.keywords['perm']"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_report_text(capsys):
    code, out, err = run(capsys, "report", str(FIXTURE))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 100
    assert lines[0] == f"graphtrace report {FIXTURE}"
    assert lines[1] == "  graphtrace 0.1.0, torch 2.13.0+cpu, created 2026-11-30T10:00:00+00:00"
    assert lines[2] == ("  2 graphs, 18 edges on 15 storages, 9 owners: 7 stale-like edges, "
                        "1 error, 1 blind spot")
    # the verdict table, row by row
    table = {line.split()[0]: line.split()[1:] for line in lines[5:13]}
    assert lines[4] == "Verdicts"
    assert lines[5].split() == ["verdict", "edges", "storages", "graphs", "manifest", "latent",
                                "unknown"]
    assert table["stable"] == ["2", "2", "1", "0", "0", "0"]
    assert table["stale"] == ["4", "2", "2", "2", "2", "0"]
    assert table["dangling"] == ["2", "1", "2", "0", "0", "2"]
    assert table["diverged"] == ["1", "1", "1", "1", "0", "0"]
    assert table["orphaned"] == ["1", "1", "1", "0", "0", "0"]
    assert table["unowned"] == ["8", "8", "2", "0", "0", "0"]
    assert table["unrefreshed"] == ["0", "0", "0", "0", "0", "0"]
    assert lines[13].split() == ["total", "18", "15", "2", "3", "2", "2"]
    # stale reads: one row per storage, most severe first, owners on their own lines
    i = lines.index("Stale reads: 7 edges on 4 storages, most severe first")
    # after each storage's owners: where it was made, where its replacement was, the fix
    j = lines.index(f"      {PERM} (attribute, moved)", i)
    assert lines[j + 1] == ("      made at: aten::_to_copy at /src/model/kernels.py:213 in "
                            "_perm_from_g_idx")
    assert lines[j + 2] == ("      now from: aten::_to_copy at /src/model/kernels.py:213 in "
                            "_perm_from_g_idx")
    assert lines[j + 3].startswith("      fix: register it on the layer and read it through")
    assert lines[j + 4].startswith(" " * 11) and lines[j + 4].strip().endswith("on reload")
    assert "      made at: before trace" in lines and "      now from: not recorded" in lines
    provenance = ("      made at: ", "      now from: ", "      fix: ", " " * 11)
    block = [line for line in lines[i + 1:] if not line.startswith(provenance)][:11]
    assert block[0].split() == ["verdict", "impact", "storage", "bytes", "graphs", "ops"]
    assert re.fullmatch(r"  stale\s+manifest\s+s2\s+32\s+decode_bs1 \+1\s+"
                        r"graphtrace::permute_cols", block[1])
    assert block[2] == f"      {PERM} (attribute, moved)"
    assert re.fullmatch(r"  diverged\s+manifest\s+s5\s+64\s+decode_bs1\s+graphtrace::machete_mm",
                        block[3])
    assert block[4] == "      layers.1.channel_scales (buffer, holds)"
    assert block[5] == "      layers.1.kernel.extra['ch_s'] (attribute, moved)"
    assert re.fullmatch(r"  dangling\s+unknown\s+s4\s+256\s+decode_bs1 \+1\s+\S+", block[6])
    assert block[7] == "      layers.1.kernel.b_q (attribute, moved)"
    assert re.fullmatch(r"  stale\s+latent\s+s3\s+128\s+decode_bs1 \+1\s+\S+", block[8])
    assert block[9] == "      layers.1.kernel.w_s (attribute, moved)"
    assert block[10] == ""
    assert "Blind spots" in lines
    assert ("  - Inductor Triton kernels launch without the dispatcher: none recorded in this "
            "run") in lines
    assert ("  - recorder.dispatch: could not classify argument 'schedule' of "
            "graphtrace::machete_mm") in lines


def test_report_text_narrow_and_top(capsys):
    code, out, _ = run(capsys, "report", str(FIXTURE), "--width", "60", "--top", "1")
    assert code == 0
    assert max(len(x) for x in out.splitlines()) <= 60
    assert "Stale reads: 7 edges on 4 storages, most severe first (to...\n" in out  # clipped
    assert "  ... 3 more storages (--top N, or --csv stale)" in out
    lines = out.splitlines()
    # an owner too long for the line: its path, then kind and status
    i = lines.index("        (attribute, moved)")
    assert lines[i - 1] == f"      {PERM}"
    code, out, _ = run(capsys, "report", str(FIXTURE), "--width", "40", "--top", "1")
    assert max(len(x) for x in out.splitlines()) <= 40
    assert "      ...ernel.act_perm.keywords['perm']" in out.splitlines()  # clipped left


def test_format_report_clean_and_long_owner_paths(tmp_path):
    rep = load_report(FIXTURE)
    e = rep.edges
    clean = Report(rep.accesses, rep.storages, rep.owners, e[~e.verdict.isin(STALE_VERDICTS)])
    text = format_report(clean)
    assert "Stale reads: none." in text and "Blind spots: none reported" in text
    assert "Errors" not in text
    long_path = "model.layers.31.mlp.experts.down_proj.quant_method.kernel.act_perm." \
                "keywords['perm']"
    owners = rep.owners.assign(path=rep.owners.path.replace(PERM, long_path))
    text = format_report(Report(rep.accesses, rep.storages, owners, e, rep.meta))
    i = text.splitlines().index(f"      {long_path}")
    assert text.splitlines()[i + 1] == "        (attribute, moved)"
    assert max(len(x) for x in text.splitlines()) <= 100


def test_report_json(capsys):
    code, out, err = run(capsys, "report", str(FIXTURE), "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["counts"] == {"stable": 2, "stale": 4, "dangling": 2, "diverged": 1,
                              "orphaned": 1, "unowned": 8, "unrefreshed": 0}
    assert data["n_edges"] == 18 and data["n_stale"] == 7 and len(data["stale"]) == 7
    assert data["summary"]["dangling"] == {"edges": 2, "storages": 1, "graphs": 2,
                                           "manifest": 0, "latent": 0, "unknown": 2}
    first = data["stale"][0]
    assert first["graph"] == "decode_bs1" and first["owners"] == PERM
    assert first["origin"] is None and first["live_data_ptr"] == 0x7F3A00102000
    assert [r["storage_id"] for r in data["stale_reads"]] == [2, 5, 4, 3]
    assert data["stale_reads"][1]["owners"] == ["layers.1.channel_scales (buffer, holds)",
                                                "layers.1.kernel.extra['ch_s'] (attribute, moved)"]
    assert data["graphs"][1]["label"] == "decode_bs8"
    assert data["torch_version"] == "2.13.0+cpu" and data["format_version"] == 1
    assert len(data["errors"]) == 1 and len(data["blind_spots"]) == 1


@pytest.mark.parametrize("table, rows, first_col", [
    (None, 7, "graph_id"), ("stale", 7, "graph_id"), ("edges", 18, "graph_id"),
    ("summary", 7, "verdict"), ("ownership", 2, "graph_id"),
])
def test_report_csv(capsys, table, rows, first_col):
    argv = ["report", str(FIXTURE), "--csv"] + ([table] if table else [])
    code, out, err = run(capsys, *argv)
    assert code == 0 and err == ""
    df = pd.read_csv(io.StringIO(out))
    assert len(df) == rows and df.columns[0] == first_col
    if table in (None, "stale"):  # the fixture predates freshness: no unrefreshed edge
        assert set(df.verdict) == set(STALE_VERDICTS) - {"unrefreshed"}


def test_csv_and_json_are_exclusive(capsys):
    code, _, err = run(capsys, "report", str(FIXTURE), "--csv", "--json")
    assert code == 2 and "not allowed with" in err


def test_fail_on_stale(capsys, tmp_path):
    code, _, _ = run(capsys, "report", str(FIXTURE), "--fail-on-stale")
    assert code == 1
    rep = load_report(FIXTURE)
    e = rep.edges
    clean = Report(rep.accesses, rep.storages, rep.owners,
                   e[~e.verdict.isin(STALE_VERDICTS)], rep.meta).to_csv(tmp_path / "clean")
    code, out, _ = run(capsys, "report", str(clean), "--fail-on-stale")
    assert code == 0 and "Stale reads: none." in out


@pytest.mark.parametrize("case, message", [
    ("missing", "no such report folder"),
    ("empty_dir", "not a graphtrace report (no manifest.json)"),
    ("foreign", "not a graphtrace report manifest (format='other-tool'"),
    ("version", "unsupported format_version 7"),
    ("missing_csv", "incomplete report: missing edges.csv"),
    ("garbage", "accesses.csv: missing columns"),
])
def test_report_bad_folder(capsys, tmp_path, case, message):
    folder = tmp_path / "r"
    if case != "missing":
        folder.mkdir()
    if case in ("foreign", "version", "missing_csv", "garbage"):
        shutil.rmtree(folder)
        shutil.copytree(FIXTURE, folder)
        m = json.loads((folder / "manifest.json").read_text())
        if case == "foreign":
            m = {"format": "other-tool"}
        if case == "version":
            m["format_version"] = 7
        (folder / "manifest.json").write_text(json.dumps(m))
        if case == "missing_csv":
            (folder / "edges.csv").unlink()
        if case == "garbage":
            (folder / "accesses.csv").write_bytes(b"\x00\x01binary,junk\n1,2\n")
    code, out, err = run(capsys, "report", str(folder))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("graphtrace report: error: ")
    assert message in err and "Traceback" not in err


def test_bad_folder_from_a_subprocess_has_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "graphtrace.cli", "report", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (f"graphtrace report: error: {tmp_path}: not a graphtrace report "
                        f"(no manifest.json)\n")


def test_version_and_usage(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"graphtrace {graphtrace.__version__}"
    code, _, err = run(capsys)
    assert code == 2 and "usage: graphtrace" in err
    code, _, err = run(capsys, "report")
    assert code == 2 and "DIR" in err
    code, _, err = run(capsys, "report", str(FIXTURE), "--bogus")
    assert code == 2 and "unrecognized arguments: --bogus" in err


def test_demo_not_available(capsys, monkeypatch):
    import graphtrace.demo as demo_pkg

    monkeypatch.delattr(demo_pkg, "runner", raising=False)
    monkeypatch.setitem(sys.modules, "graphtrace.demo.runner", None)
    code, out, err = run(capsys, "demo", "--out", "x")
    assert code == 2 and out == ""
    assert err == ("graphtrace demo: error: demo not available in this installation "
                   "(graphtrace.demo.runner is missing)\n")


def test_demo_delegates_to_runner(capsys, monkeypatch):
    import graphtrace.demo as demo_pkg

    seen = {}
    fake = types.ModuleType("graphtrace.demo.runner")
    fake.__doc__ = "Run the demo."

    def add_arguments(parser):
        parser.add_argument("--out", default="demo-out")
        parser.add_argument("--steps", type=int, default=1)

    def run_demo(args):
        seen["args"] = args
        print(f"demo wrote {args.out}")
        return 3

    fake.add_arguments, fake.run = add_arguments, run_demo
    monkeypatch.setitem(sys.modules, "graphtrace.demo.runner", fake)
    monkeypatch.setattr(demo_pkg, "runner", fake, raising=False)
    code, out, _ = run(capsys, "demo", "--out", "here", "--steps", "2")
    assert code == 3 and out == "demo wrote here\n"
    assert (seen["args"].out, seen["args"].steps) == ("here", 2)
    code, out, _ = run(capsys, "demo", "--help")
    assert code == 0 and "usage: graphtrace demo" in out and "--steps" in out
    code, _, err = run(capsys, "demo", "--nope")
    assert code == 2 and "unrecognized arguments: --nope" in err


def test_report_on_the_demo_folder(capsys, tmp_path):
    """The terminal report on a folder `graphtrace demo` writes (needs torch)."""
    pytest.importorskip("torch")
    try:
        from graphtrace.demo import runner  # noqa: F401
    except ImportError:
        pytest.skip("graphtrace.demo.runner not available")
    out_dir = tmp_path / "demo"
    code, _, _ = run(capsys, "demo", "--variant", "unfixed-partial", "--variant", "fixed",
                     "--device", "cpu", "--backend", "builtin", "--batch-sizes", "1,8",
                     "--layers", "2", "--quiet", "--out", str(out_dir))
    assert code == 0
    code, out, err = run(capsys, "report", str(out_dir / "unfixed-partial" / "new-weights"),
                         "--fail-on-stale")
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 100
    i = next(k for k, x in enumerate(lines) if x.startswith("Stale reads: 4 edges on 2 "))
    for layer in (0, 1):
        owner = (f"      layers.{layer}.mlp.down_proj.quant_method.kernel.act_perm."
                 f"keywords['perm'] (attribute, moved)")
        assert owner in lines[i:]
    assert re.fullmatch(r"  stale\s+manifest\s+s\d+\s+\d+\s+bs1 \+1\s+graphtrace::permute_cols",
                        lines[i + 2])
    code, out, _ = run(capsys, "report", str(out_dir / "fixed" / "new-weights"),
                       "--fail-on-stale")
    assert code == 0 and "Stale reads: none." in out
    code, out, _ = run(capsys, "report", str(out_dir / "unfixed-partial" / "same-weights"),
                       "--json")
    data = json.loads(out)
    assert data["counts"]["stale"] == 4
    assert {r["impact"] for r in data["stale"]} == {"latent"}


def test_demo_bad_options_say_why_without_a_traceback(capsys, tmp_path):
    pytest.importorskip("torch")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = run(capsys, "demo", "--variant", "fixed", "--out", str(blocker / "sub"))
    assert code == 2 and "cannot write the report folder" in err and "Traceback" not in err
    code, _, err = run(capsys, "demo", "--batch-sizes", "0,x")
    assert code == 2 and "--batch-sizes must be integers" in err
