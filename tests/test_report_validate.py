"""Reports under bad input: every defect a folder or frame can have is one ReportError that
names the file (or frame), the column and the first bad row; to_csv is atomic; the CLI
says one line; ownership_by_graph counts storages apart from edges.

See Note [What a report folder guarantees] in graphtrace/report/io.py.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import graphtrace.report.io as report_io
import graphtrace.vocab as vocab
from graphtrace.cli import main
from graphtrace.explore import ownership_by_graph
from graphtrace.report import MANIFEST, Report, ReportError, load_report

FIXTURE = Path(__file__).parent / "data" / "reload_report"
REPO = Path(__file__).resolve().parents[1]
FRAMES = ("accesses", "storages", "owners", "edges")


@pytest.fixture(scope="module")
def original() -> Report:
    return load_report(FIXTURE)


def assert_reports_equal(a: Report, b: Report) -> None:
    for name in FRAMES:
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), obj=name)
    assert a.meta == b.meta


def copy_fixture(tmp_path: Path) -> Path:
    """The hand-made fixture folder (no row counts, no checksums: an old-style folder)."""
    dst = tmp_path / "rep"
    shutil.copytree(FIXTURE, dst)
    return dst


def read_rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def write_rows(path: Path, rows: list[list[str]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def set_cell(folder: Path, frame: str, row: int, column: str, value: str) -> None:
    rows = read_rows(folder / f"{frame}.csv")
    rows[row + 1][rows[0].index(column)] = value
    write_rows(folder / f"{frame}.csv", rows)


def edit_manifest(folder: Path, change) -> None:
    """Change the manifest (a JSON object) with ``change(m)``; drops its checksum so that
    the change itself is what load meets."""
    m = json.loads((folder / MANIFEST).read_text())
    m.pop("checksum", None)
    change(m)
    (folder / MANIFEST).write_text(json.dumps(m))


def one_line_error(folder: Path, pattern: str) -> str:
    with pytest.raises(ReportError, match=pattern) as info:
        load_report(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- vocabularies

VOCAB_CASES = [
    ("edges", "verdict", 0, vocab.VERDICTS),
    ("edges", "impact", 1, vocab.IMPACTS),
    ("edges", "origin", 0, vocab.ORIGINS),
    ("edges", "access", 4, vocab.EDGE_ACCESSES),
    ("owners", "status", 2, vocab.OWNER_STATUSES),
    ("owners", "kind", 5, vocab.OWNER_KINDS),
    ("accesses", "access", 7, vocab.ACCESS_KINDS),
    ("storages", "first_access", 3, vocab.ACCESS_KINDS),
]


@pytest.mark.parametrize("frame, column, row, words", VOCAB_CASES,
                         ids=[f"{f}.{c}" for f, c, _, _ in VOCAB_CASES])
def test_values_outside_the_vocabulary_name_file_column_and_row(tmp_path, original, frame,
                                                                 column, row, words):
    folder = copy_fixture(tmp_path)
    set_cell(folder, frame, row, column, "bogus")
    message = one_line_error(folder, "unknown value 'bogus'")
    assert message.startswith(f"{folder / (frame + '.csv')}: column {column}, "
                              f"row {row} (line {row + 2}): unknown value 'bogus'")
    assert ", ".join(words) in message
    # the same defect in memory names the frame
    frames = {n: getattr(original, n).copy() for n in FRAMES}
    df = frames[frame]
    df[column] = df[column].astype(object)
    df.loc[row, column] = "bogus"
    with pytest.raises(ReportError, match=rf"^{frame}\.{column}, row {row}: unknown value"):
        Report.from_frames(**frames, meta=original.meta)


def test_owner_kinds_are_checked_part_by_part(tmp_path):
    folder = copy_fixture(tmp_path)
    set_cell(folder, "edges", 8, "owner_kinds", "attribute;weights")
    one_line_error(folder, r"edges.csv: column owner_kinds, row 8 \(line 10\): unknown value "
                           r"'weights' in 'attribute;weights'")
    set_cell(folder, "edges", 8, "owner_kinds", "attribute;buffer")  # the fixture's value
    load_report(folder)


def test_a_verdict_that_must_not_be_missing(tmp_path):
    folder = copy_fixture(tmp_path)
    set_cell(folder, "edges", 2, "verdict", "")
    one_line_error(folder, r"column verdict, row 2 \(line 4\): unknown value ''")


# --------------------------------------------------------------------------- keys, references

def _append_copy(folder: Path, frame: str, row: int) -> int:
    rows = read_rows(folder / f"{frame}.csv")
    rows.append(list(rows[row + 1]))
    write_rows(folder / f"{frame}.csv", rows)
    return len(rows) - 2


@pytest.mark.parametrize("frame, row, columns", [
    ("edges", 3, "graph_id, storage_id"),
    ("storages", 5, "storage_id"),
    ("owners", 1, "storage_id, model, path"),
])
def test_duplicate_keys(tmp_path, frame, row, columns):
    folder = copy_fixture(tmp_path)
    dup = _append_copy(folder, frame, row)
    message = one_line_error(folder, "duplicate key")
    prefix = "columns" if ", " in columns else "column"
    assert message.startswith(f"{folder / (frame + '.csv')}: {prefix} {columns}, row {dup} "
                              f"(line {dup + 2}): duplicate key (")


def test_duplicate_keys_next_to_each_other(tmp_path):
    """A duplicate right after its row keeps the frame sorted (the neighbour check finds it),
    in a folder's storages and in a diff's own (sorted) edges."""
    folder = copy_fixture(tmp_path)
    rows = read_rows(folder / "storages.csv")
    rows.insert(7, list(rows[6]))
    write_rows(folder / "storages.csv", rows)
    message = one_line_error(folder, "duplicate key")
    assert message.startswith(f"{folder / 'storages.csv'}: column storage_id, row 6 (line 8): "
                              "duplicate key (")

    import torch

    import graphtrace as gt

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with gt.trace(model) as t, torch.no_grad():
        with gt.capture("g"):
            model(torch.rand(2, 4))
    report = t.diff()
    edges = report.edges
    keys = list(zip(edges["graph_id"], edges["storage_id"]))
    assert keys == sorted(keys) and len(edges) > 3
    doubled = pd.concat([edges.iloc[:3], edges.iloc[2:3], edges.iloc[3:]], ignore_index=True)
    with pytest.raises(gt.ReportError, match=r"edges \(graph_id, storage_id\), row 3: "
                                             r"duplicate key"):
        gt.Report(accesses=report.accesses, storages=report.storages, owners=report.owners,
                  edges=doubled, meta=report.meta)


def test_duplicate_storage_id_with_other_values(tmp_path):
    folder = copy_fixture(tmp_path)
    set_cell(folder, "storages", 7, "storage_id", "2")
    one_line_error(folder, r"storages.csv: column storage_id, row 7 \(line 9\): duplicate key "
                           r"\(storage_id=2\)")


def test_repeated_access_rows_are_legal(tmp_path, original):
    """aten::cat([y, y]) records two equal rows: accesses has no key."""
    folder = copy_fixture(tmp_path)
    _append_copy(folder, "accesses", 0)
    r = load_report(folder)
    assert len(r.accesses) == len(original.accesses) + 1


@pytest.mark.parametrize("frame, row", [("edges", 5), ("owners", 3), ("accesses", 9)])
def test_storage_ids_must_exist(tmp_path, frame, row):
    folder = copy_fixture(tmp_path)
    set_cell(folder, frame, row, "storage_id", "99")
    one_line_error(folder, rf"{frame}.csv: column storage_id, row {row} \(line {row + 2}\): "
                           r"storage 99 is not in storages")


def test_frames_without_storages_are_not_checked_for_references(original):
    r = Report.from_frames(edges=original.edges)  # a hand-built report of edges only
    assert len(r.edges) == len(original.edges)


def test_typed_values_name_their_row(tmp_path):
    folder = copy_fixture(tmp_path)
    set_cell(folder, "owners", 4, "live_data_ptr", "0x10")
    one_line_error(folder, r"owners.csv: column live_data_ptr, row 4 \(line 6\): cannot read "
                           r"'0x10' as Int")
    folder = copy_fixture(tmp_path / "b")
    set_cell(folder, "storages", 2, "alive", "yes")
    one_line_error(folder, r"storages.csv: column alive, row 2 \(line 4\): cannot read 'yes'")
    folder = copy_fixture(tmp_path / "c")
    set_cell(folder, "edges", 6, "nbytes", str(2**64))
    one_line_error(folder, r"edges.csv: column nbytes, row 6 \(line 8\)")


# --------------------------------------------------------------------------- cut files

def test_a_last_line_cut_inside_a_field_is_found(tmp_path):
    """storages.csv cut inside the last data_ptr: it would still parse (as a smaller
    number); the missing newline gives it away, even without a manifest row count."""
    folder = copy_fixture(tmp_path)
    data = (folder / "storages.csv").read_bytes()
    cut = data.rindex(b"\n", 0, len(data) - 1) + 8  # "14,13988..." -> "14,139887"
    (folder / "storages.csv").write_bytes(data[:cut])
    one_line_error(folder, r"storages.csv: the file does not end with a newline: its last "
                           r"line is cut")


def test_written_folders_record_rows_checksums(tmp_path, original):
    out = original.to_csv(tmp_path / "w")
    m = json.loads((out / MANIFEST).read_text())
    assert m["rows"] == {n: len(getattr(original, n)) for n in FRAMES}
    assert set(m["sha256"]) == {f"{n}.csv" for n in FRAMES} | {"graph.graphml"}
    assert len(m["checksum"]) == 64


def test_lines_cut_at_a_line_end_are_counted(tmp_path, original):
    out = original.to_csv(tmp_path / "w")
    lines = (out / "edges.csv").read_text().splitlines(keepends=True)
    (out / "edges.csv").write_text("".join(lines[:-2]))
    one_line_error(out, r"edges.csv: the file differs from the one written \(its SHA-256 "
                        r"does not match manifest.json\)")
    edit_manifest(out, lambda m: m.pop("sha256"))  # an older writer: rows only
    one_line_error(out, r"edges.csv: 16 rows, but manifest.json records 18: rows were lost")


def test_an_edited_manifest_fails_its_checksum(tmp_path, original):
    out = original.to_csv(tmp_path / "w")
    text = (out / MANIFEST).read_text().replace('"decode_bs8"', '"decode_bs9"')
    (out / MANIFEST).write_text(text)
    one_line_error(out, "manifest.json: the manifest differs from the one written")
    # whitespace is no change
    (out / MANIFEST).write_text(json.dumps(json.loads(
        (out / MANIFEST).read_text().replace("decode_bs9", "decode_bs8"))))
    assert_reports_equal(load_report(out), original)


# --------------------------------------------------------------------------- manifest types

MANIFEST_CASES = {
    "files-list": (lambda m: m.update(files=["edges.csv"]), r"files: expected an object"),
    "files-int": (lambda m: m.update(files={"edges": 3}), r"files.edges: expected a file name"),
    "files-path": (lambda m: m.update(files={"edges": "../x.csv"}), "files.edges"),
    "files-unknown": (lambda m: m.update(files={"nodes": "n.csv"}), r"files.nodes: expected one"),
    "dtypes-kind": (lambda m: m.update(dtypes={"edges": {"verdict": "int"}}),
                    r"dtypes.edges.verdict: expected 'str', got 'int'"),
    "dtypes-extra": (lambda m: m.update(dtypes={"edges": {"x": "complex"}}),
                     r"dtypes.edges.x: expected one of int"),
    "dtypes-frame": (lambda m: m.update(dtypes={"nodes": {}}), r"dtypes.nodes"),
    "dtypes-list": (lambda m: m.update(dtypes={"edges": ["verdict"]}),
                    r"dtypes.edges: expected an object"),
    "categorical": (lambda m: m.update(categorical={"edges": "verdict"}),
                    r"categorical.edges: expected a list of column names"),
    "categorical-column": (lambda m: m.update(categorical={"edges": ["nope"]}),
                           r"edges.csv: manifest.json says column nope is categorical"),
    "rows-negative": (lambda m: m.update(rows={"edges": -1}), r"rows.edges: expected an int"),
    "rows-text": (lambda m: m.update(rows={"edges": "18"}), r"rows.edges"),
    "rows-bool": (lambda m: m.update(rows={"edges": True}), r"rows.edges"),
    "sha256": (lambda m: m.update(sha256={"edges.csv": "zz"}), r"sha256.edges.csv: expected"),
    "checksum": (lambda m: m.update(checksum=5), r"checksum: expected a SHA-256"),
    "version-float": (lambda m: m.update(format_version=1.0), "unsupported format_version"),
    "version-bool": (lambda m: m.update(format_version=True), "unsupported format_version"),
    "version-text": (lambda m: m.update(format_version="1"), "unsupported format_version"),
    "version-list": (lambda m: m.update(format_version=[1]), "unsupported format_version 'list'"),
    "format-dict": (lambda m: m.update(format={"a": 1}), r"format='dict'"),
    "torch_version": (lambda m: m.update(torch_version=2), r"torch_version: expected a string"),
    "written": (lambda m: m.update(written=[]), r"written: expected a string"),
    "meta-list": (lambda m: m.update(meta=[1]), r"meta: expected an object"),
}

META_CASES = {
    "errors-text": ({"errors": "boom"}, r"meta.errors: expected a list"),
    "errors-item": ({"errors": ["boom"]}, r"meta.errors\[0\]: expected an object"),
    "errors-where": ({"errors": [{"where": 1, "message": "m"}]},
                     r"meta.errors\[0\].where: expected a string"),
    "n_errors-text": ({"n_errors": "1"}, r"meta.n_errors: expected an integer >= 0"),
    "n_errors-negative": ({"n_errors": -1}, r"meta.n_errors"),
    "blind_spots": ({"blind_spots": [1]}, r"meta.blind_spots\[0\]: expected a string or"),
    "blind_spots-dict": ({"blind_spots": {"a": 1}}, r"meta.blind_spots: expected a list"),
    "graphs-dict": ({"graphs": {"0": {}}}, r"meta.graphs: expected a list"),
    "graphs-no-id": ({"graphs": [{"label": "x"}]}, r"meta.graphs\[0\]: no graph_id"),
    "graphs-id-text": ({"graphs": [{"graph_id": "0"}]},
                       r"meta.graphs\[0\].graph_id: expected an integer >= 0"),
    "graphs-n_ops": ({"graphs": [{"graph_id": 0, "n_ops": 1.5}]}, r"meta.graphs\[0\].n_ops"),
    "graphs-label": ({"graphs": [{"graph_id": 0, "label": ["a"]}]},
                     r"meta.graphs\[0\].label: expected a string"),
    "graphs-twice": ({"graphs": [{"graph_id": 0}, {"graph_id": 0}]},
                     r"meta.graphs\[1\].graph_id: graph 0 listed twice"),
    "models": ({"models": [None]}, r"meta.models\[0\]: expected a string"),
    "created": ({"created": 5}, r"meta.created: expected a string"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_manifest_fields_of_the_wrong_type(tmp_path, original, case):
    change, pattern = MANIFEST_CASES[case]
    out = original.to_csv(tmp_path / "w")
    edit_manifest(out, change)
    message = one_line_error(out, pattern)
    assert str(out) in message


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_meta_values_of_the_wrong_type(tmp_path, original, case):
    values, pattern = META_CASES[case]
    out = original.to_csv(tmp_path / "w")
    edit_manifest(out, lambda m: m["meta"].update(values))
    message = one_line_error(out, pattern)
    assert message.startswith(f"{out / MANIFEST}: meta")
    # in memory too: bad meta never makes a Report whose repr or graphs then break
    with pytest.raises(ReportError, match=pattern):
        Report.from_frames(meta={**original.meta, **values})


def test_meta_left_out_or_null_is_fine(original):
    r = Report.from_frames(meta={"errors": None, "graphs": None, "n_errors": None})
    assert "0 graphs" in repr(r) and len(r.graphs) == 0


@pytest.mark.parametrize("depth", [800, 5000, 100_000])
def test_a_deeply_nested_manifest_is_a_report_error(tmp_path, original, depth):
    folder = copy_fixture(tmp_path)
    (folder / MANIFEST).write_text("[" * depth + "]" * depth)
    one_line_error(folder, "manifest.json: ")
    out = original.to_csv(tmp_path / "w")
    edit_manifest(out, lambda m: m["meta"].update(x="DEEP"))
    text = (out / MANIFEST).read_text().replace('"DEEP"', "[" * depth + "]" * depth)
    (out / MANIFEST).write_text(text)
    try:
        r = load_report(out)
    except ReportError as e:
        assert "\n" not in str(e)
    else:  # shallow enough to read, write and read back
        assert depth < 1000
        assert_reports_equal(load_report(r.to_csv(tmp_path / "again")), r)


# --------------------------------------------------------------------------- fuzz

def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data))
    op = rng.choice(["flip", "delete", "insert", "truncate", "dup-line", "drop-line", "swap"])
    if op == "flip":
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]
    if op == "delete":
        return data[:i] + data[i + 1:]
    if op == "insert":
        return data[:i] + bytes([rng.choice(b"0123456789,;\"\n xe.-")]) + data[i:]
    if op == "truncate":
        return data[:i]
    lines = data.splitlines(keepends=True)
    j = rng.randrange(len(lines))
    if op == "dup-line":
        return b"".join(lines[:j + 1] + lines[j:])
    if op == "drop-line":
        return b"".join(lines[:j] + lines[j + 1:])
    k = rng.randrange(len(lines))
    lines[j], lines[k] = lines[k], lines[j]
    return b"".join(lines)


NASTY = ["", "x", "-1", "0", "nan", "NA", "None", "1e400", "True", "False", str(2**63),
         "read", "stale", "manifest", "holds", "attribute", "\"", ",", "a;b", " 1", "1.5",
         "parameter;buffer", "internal", "view"]


def _check_or_round_trip(folder: Path, original: Report, *, checked: bool) -> str:
    """Load ``folder``: a ReportError, or the original report exactly. A folder without
    row counts or checksums (``checked=False``) may hold another valid report: then it
    must display, and write and read back exactly."""
    try:
        r = load_report(folder)
    except ReportError as e:
        assert "\n" not in str(e)
        return "error"
    try:
        assert_reports_equal(r, original)
        return "equal"
    except AssertionError:
        if checked:
            raise
    repr(r)
    r.summary()
    r.graphs  # noqa: B018
    r._repr_html_()
    assert r.graph.number_of_nodes() > 0
    back = load_report(r.to_csv(folder.parent / (folder.name + "-again")))
    assert_reports_equal(back, r)
    return "other"


def test_fuzz_bytes_of_a_written_folder(tmp_path, original):
    """Byte mutations of a folder to_csv wrote: each loads as a ReportError or equal."""
    rng = random.Random(19)
    base = original.to_csv(tmp_path / "base")
    files = [*(f"{n}.csv" for n in FRAMES), MANIFEST]
    outcomes = {"error": 0, "equal": 0}
    for i in range(240):
        folder = tmp_path / f"v{i}"
        shutil.copytree(base, folder)
        name = files[i % len(files)]
        path = folder / name
        path.write_bytes(_mutate_bytes(path.read_bytes(), rng))
        outcomes[_check_or_round_trip(folder, original, checked=True)] += 1
        shutil.rmtree(folder)
    assert outcomes["error"] > 150  # most mutations are damage


def test_fuzz_columns_of_an_unchecked_folder(tmp_path, original):
    """Every column of every frame, a cell set to a nasty value, in a folder without row
    counts or checksums (as old folders are): a ReportError, or a report that works."""
    rng = random.Random(1919)
    outcomes = {"error": 0, "equal": 0, "other": 0}
    i = 0
    for frame in FRAMES:
        header = read_rows(FIXTURE / f"{frame}.csv")[0]
        n_rows = len(read_rows(FIXTURE / f"{frame}.csv")) - 1
        for column in header:
            for value in rng.sample(NASTY, 4):
                folder = tmp_path / f"c{i}"
                i += 1
                shutil.copytree(FIXTURE, folder)
                set_cell(folder, frame, rng.randrange(n_rows), column, value)
                outcomes[_check_or_round_trip(folder, original, checked=False)] += 1
                shutil.rmtree(folder)
                shutil.rmtree(folder.parent / (folder.name + "-again"), ignore_errors=True)
    assert i > 150 and outcomes["error"] > 50 and outcomes["other"] > 10


# --------------------------------------------------------------------------- atomic writes

def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture()
def old_and_new(tmp_path, original):
    """A folder holding the fixture report plus a user's file, and a different report."""
    out = original.to_csv(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    new = Report.from_frames(original.accesses, original.storages, original.owners,
                             original.edges.iloc[:5], dict(original.meta, models=["other"]))
    return out, new


def _raise_on(monkeypatch, target: str, after_writing: bool) -> None:
    real = pd.DataFrame.to_csv

    def to_csv(self, path=None, *args, **kwargs):
        if path is not None and Path(str(path)).name == target:
            if after_writing:
                real(self.iloc[: len(self) // 2], path, *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "to_csv", to_csv)


@pytest.mark.parametrize("target", ["storages.csv", "edges.csv"])
def test_a_failed_write_leaves_the_old_report_whole(old_and_new, original, monkeypatch,
                                                    target):
    out, new = old_and_new
    before = _files(out)
    _raise_on(monkeypatch, target, after_writing=True)
    with pytest.raises(OSError, match="No space left"):
        new.to_csv(out)
    monkeypatch.undo()
    assert _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no staging folder left
    assert_reports_equal(load_report(out), original)


def test_a_failure_while_swapping_puts_the_old_files_back(old_and_new, original, monkeypatch):
    out, new = old_and_new
    before = _files(out)
    real = os.replace

    def replace(src, dst):
        if Path(dst) == out / MANIFEST and ".graphtrace-write-" in str(src) \
                and "old-" not in str(src):
            raise PermissionError(13, "Permission denied")  # the new manifest's move
        return real(src, dst)

    monkeypatch.setattr(report_io.os, "replace", replace)
    with pytest.raises(PermissionError):
        new.to_csv(out)
    monkeypatch.undo()
    assert _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
    assert_reports_equal(load_report(out), original)


def test_a_successful_write_replaces_only_the_reports_files(old_and_new):
    out, new = old_and_new
    new.to_csv(out, graphml=False)
    assert not (out / "graph.graphml").exists()  # the old report's GraphML went with it
    assert (out / "notes.txt").read_text() == "mine"
    assert_reports_equal(load_report(out), new)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(f"{n}.csv" for n in FRAMES), MANIFEST, "notes.txt"])


def test_a_failed_write_to_a_new_folder_leaves_nothing(tmp_path, original, monkeypatch):
    _raise_on(monkeypatch, "owners.csv", after_writing=True)
    with pytest.raises(OSError):
        original.to_csv(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_users_folder_is_written_into_but_never_overwritten(tmp_path, original):
    user = tmp_path / "user"
    user.mkdir()
    (user / "data.txt").write_text("keep")
    original.to_csv(user)
    assert (user / "data.txt").read_text() == "keep"
    assert_reports_equal(load_report(user), original)

    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "edges.csv").write_text("my own edges\n")
    with pytest.raises(ReportError, match=r"holds edges.csv but is not a graphtrace report"):
        original.to_csv(clash)
    assert (clash / "edges.csv").read_text() == "my own edges\n"
    assert sorted(p.name for p in clash.iterdir()) == ["edges.csv"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / MANIFEST).write_text('{"name": "my package"}')
    with pytest.raises(ReportError, match="not a graphtrace report's; not overwriting"):
        original.to_csv(foreign)

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ReportError, match="exists and is not a folder"):
        original.to_csv(a_file)


# --------------------------------------------------------------------------- CLI

def _bad_folders(tmp_path: Path, original: Report) -> dict[str, Path]:
    out = {}
    f = copy_fixture(tmp_path / "vocab")
    set_cell(f, "owners", 2, "status", "gone")
    out["vocab"] = f
    f = original.to_csv(tmp_path / "meta")
    edit_manifest(f, lambda m: m["meta"].update(graphs=[{"graph_id": "x"}]))
    out["meta"] = f
    f = original.to_csv(tmp_path / "cut")
    (f / "edges.csv").write_bytes((f / "edges.csv").read_bytes()[:-7])
    out["cut"] = f
    f = copy_fixture(tmp_path / "deep")
    (f / MANIFEST).write_text("[" * 50_000)
    out["deep"] = f
    f = copy_fixture(tmp_path / "dup")
    _append_copy(f, "edges", 2)
    out["dup"] = f
    return out


@pytest.mark.parametrize("mode", [[], ["--json"], ["--csv"], ["--csv", "ownership"],
                                  ["--fail-on-stale"]], ids=lambda m: " ".join(m) or "text")
def test_cli_bad_folders_one_line_exit_2(tmp_path, original, capsys, mode):
    for case, folder in _bad_folders(tmp_path, original).items():
        code = main(["report", str(folder), *mode])
        out, err = capsys.readouterr()
        assert code == 2, case
        assert out == "", case
        assert err.count("\n") == 1 and err.startswith("graphtrace report: error: "), case
        assert "Traceback" not in err and str(folder) in err, case


def test_cli_bad_folder_in_a_subprocess(tmp_path, original):
    folder = _bad_folders(tmp_path, original)["meta"]
    for mode in ([], ["--json"]):
        p = subprocess.run([sys.executable, "-m", "graphtrace", "report", str(folder), *mode],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert p.returncode == 2 and p.stdout == ""
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
        assert "meta.graphs[0].graph_id" in p.stderr


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from graphtrace.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["demo"], ["demo", "--quick"]])
def test_demo_without_torch_says_how_to_install_it(argv):
    p = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True,
                       text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2, p.stderr
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr == ("graphtrace demo: error: this command needs torch, which is not "
                        "installed: pip install 'graphtrace[torch]'\n")


def test_report_command_works_without_torch():
    p = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "report", str(FIXTURE), "--json"],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["n_edges"] == 18


# --------------------------------------------------------------------------- ownership by graph

def test_ownership_by_graph_counts_a_storage_touched_only_through_a_view(original):
    """Graph 1 makes a view of a storage (s15) it never reads or writes: one storage more
    than its edges; graph 0 is unchanged."""
    acc = original.accesses.astype({c: object for c in ("graph", "op", "module", "arg",
                                                        "access", "dtype", "shape",
                                                        "stride", "device")})
    view = {"graph_id": 1, "graph": "decode_bs8", "seq": 2, "op": "aten::view",
            "module": "layers.1", "arg": "self", "access": "view", "storage_id": 15,
            "data_ptr": 139887084892160, "dtype": "float32", "shape": "(8, 16)",
            "stride": "(16, 1)", "offset": 0, "device": "cpu"}
    acc = pd.concat([acc, pd.DataFrame([view, {**view, "arg": "out", "shape": "(128,)",
                                               "stride": "(1,)"}])], ignore_index=True)
    sto = pd.concat([original.storages.astype({"device": object, "first_access": object}),
                     pd.DataFrame([{"storage_id": 15, "data_ptr": 139887084892160,
                                    "nbytes": 512, "device": "cpu", "alive": True,
                                    "first_access": "view"}])], ignore_index=True)
    meta = dict(original.meta)
    meta["graphs"] = [dict(g, n_ops=3, n_accesses=9) if g["graph_id"] == 1 else g
                      for g in meta["graphs"]]
    r = Report.from_frames(acc, sto, original.owners, original.edges, meta)
    cov = ownership_by_graph(r).set_index("graph_id")
    assert cov.loc[1, ["accesses", "storages", "edges", "owned"]].tolist() == [9, 7, 6, 3]
    assert cov.loc[0, ["accesses", "storages", "edges", "owned"]].tolist() == [17, 12, 12, 7]
    before = ownership_by_graph(original).set_index("graph_id")
    assert before.loc[1, "storages"] == before.loc[1, "edges"] == 6


def test_ownership_by_graph_of_a_real_trace_with_a_view_only_storage():
    torch = pytest.importorskip("torch")
    import graphtrace as gt

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 4))
            self.unused = torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            self.unused.view(2, 4)  # a view, never read: a storage, no edge
            return x @ self.weight

    model = Model()
    with torch.no_grad(), gt.trace(model) as t:
        with gt.capture("g"):
            model(torch.randn(2, 4))
    r = t.diff()
    cov = ownership_by_graph(r).iloc[0]
    edge_sids = set(r.edges["storage_id"])
    access_sids = set(r.accesses["storage_id"])
    assert len(access_sids - edge_sids) == 1
    assert cov["storages"] == len(access_sids) == cov["edges"] + 1
    assert cov["edges"] == len(edge_sids) and cov["owned"] == 1
