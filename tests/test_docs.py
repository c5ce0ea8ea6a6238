"""The docs match the code: the words and columns graphtrace.vocab defines, no more, no fewer,
in order; the layout table against the tree (described in docs/internals.md only); the README
as a short front door whose links resolve and whose example runs; every command-line option
the docs name exists; the vLLM page names every variable and option the adapter reads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrace import vocab

ROOT = Path(__file__).resolve().parents[1]
INTERNALS = ROOT / "docs" / "internals.md"
VLLM_DOC = ROOT / "docs" / "vllm.md"
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of any level."""
    m = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#|\Z)", text, re.S | re.M)
    assert m, f"no heading {heading!r}"
    return m.group(1)


def first_column(table_text: str) -> list[str]:
    """The first cell of each body row of the first markdown table in `table_text`, unquoted."""
    rows = [line for line in table_text.splitlines() if line.startswith("|")]
    return [row.split("|")[1].strip().strip("`") for row in rows[2:]]


def test_internals_holds_the_generated_vocabulary_tables():
    assert vocab.markdown_tables() in INTERNALS.read_text()


def test_markdown_tables_cover_every_word_and_column():
    out = vocab.markdown_tables()
    for name in ("VERDICTS", "IMPACTS", "ORIGINS", "OWNER_STATUSES", "OWNER_KINDS"):
        assert f"| `{name}` | " + ", ".join(f"`{w}`" for w in getattr(vocab, name)) + " |" in out
    for frame, cols in vocab.SCHEMA.items():
        assert f"| `{frame}` | " + ", ".join(f"`{c}` {k}" for c, k in cols) + " |" in out


def test_command_line_prints_the_tables():
    proc = subprocess.run([sys.executable, "-m", "graphtrace.vocab", "--markdown"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == vocab.markdown_tables()


def test_command_line_without_markdown_says_what_it_needs():
    proc = subprocess.run([sys.executable, "-m", "graphtrace.vocab"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--markdown" in proc.stderr


def test_readme_verdict_table_lists_the_verdicts_in_order():
    assert first_column(section(README.read_text(), "Verdicts")) == list(vocab.VERDICTS)


@pytest.mark.parametrize("frame", vocab.FRAMES)
def test_internals_frame_prose_names_every_column_in_order(frame):
    """The prose under "Frames a Report holds" names each frame's columns in schema order."""
    prose = section(INTERNALS.read_text(), "Frames a Report holds (all plain pandas; strings "
                                           "may be categoricals in memory)")
    m = re.search(rf"^`{frame}` \(.*?(?=^`\w+` \(|\Z)", prose, re.S | re.M)
    assert m, f"no paragraph for {frame}"
    columns = set(vocab.COLUMNS[frame])
    named = []
    for word in re.findall(r"`([^`]+)`", m.group(0))[1:]:  # [0] is the frame's own name
        if word in columns and word not in named:
            named.append(word)
    assert named == vocab.COLUMNS[frame]


def test_section_finds_nothing_for_a_missing_heading():
    with pytest.raises(AssertionError, match="no heading"):
        section("# a\ntext\n", "b")


def _package_entries() -> list[str]:
    """graphtrace's top-level modules and subpackages, as the layout tables name them."""
    pkg = ROOT / "graphtrace"
    out = [f"graphtrace/{p.name}" for p in sorted(pkg.glob("*.py"))
           if p.name not in ("__main__.py", "__init__.py")]
    out += [f"graphtrace/{p.name}/" for p in sorted(pkg.iterdir())
            if p.is_dir() and (p / "__init__.py").exists()]
    return out


def test_internals_layout_names_every_module():
    layout = section(INTERNALS.read_text(), "Layout")
    missing = [entry for entry in _package_entries() if f"`{entry}`" not in layout]
    assert not missing, f"internals.md's Layout table does not name {missing}"
    for named in re.findall(r"`(graphtrace/[\w/.]+)`", layout):
        assert (ROOT / named).exists(), f"internals.md's Layout names {named}, which does not exist"
    for folder in _tracked_top_level_folders():
        assert f"| `{folder}/` |" in layout, f"internals.md's Layout does not name {folder}/"


def _tracked_top_level_folders() -> list[str]:
    """The repository's top-level folders under version control (graphtrace/ has its rows)."""
    proc = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    tops = {line.split("/")[0] for line in proc.stdout.splitlines() if "/" in line}
    folders = sorted(f for f in tops if not f.startswith(".") and f != "graphtrace")
    assert {"analysis", "tests", "docs", "notebooks"} <= set(folders), folders
    return folders


def test_the_layout_is_described_in_one_place_only():
    for doc in DOCS:
        if doc == INTERNALS:
            continue
        text = doc.read_text()
        assert not re.search(r"^#+ Layout\b", text, re.M), f"{doc.name} has a Layout section"
        rows = re.findall(r"^\| `graphtrace/[\w/.]+` \|", text, re.M)
        assert not rows, f"{doc.name} describes modules in a table: {rows[:3]}"
    assert "docs/internals.md#layout" in README.read_text()


def _env_reads(path: Path) -> set[str]:
    """The environment variables a module reads: ``os.environ.get(X)``, ``os.environ[X]``,
    ``os.getenv(X)``, ``X in os.environ``, with X a literal or a module-level string
    constant."""
    import ast

    tree = ast.parse(path.read_text())
    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
              for t in node.targets if isinstance(t, ast.Name)}

    def name(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return consts.get(node.id) if isinstance(node, ast.Name) else None

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = set()
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in ("get", "pop") and is_environ(f.value)) or f.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None:
            assert name(key), f"{path.name}:{node.lineno}: an environment read by a name " \
                              "this test cannot resolve"
            found.add(name(key))
    return found


def test_vllm_doc_names_every_variable_the_vllm_package_reads():
    files = sorted((ROOT / "graphtrace" / "vllm").glob("*.py")) + [
        ROOT / "graphtrace" / "provenance.py"]  # the plugin's trace reads it
    read = set().union(*(_env_reads(f) for f in files))
    assert {"GRAPHTRACE_VLLM", "GRAPHTRACE_VLLM_DIR", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "GRAPHTRACE_PROVENANCE"} <= read  # the scan sees constants and literals
    text = section(VLLM_DOC.read_text(), "Worker processes: the plugin")
    missing = sorted(v for v in read if f"| `{v}` |" not in text)
    assert not missing, f"docs/vllm.md's variable table does not name {missing}"


def test_vllm_doc_documents_every_trace_llm_option():
    import inspect

    from graphtrace.vllm.adapter import VllmTrace

    text = section(VLLM_DOC.read_text(), "In process: `trace_llm`")
    options = [p for p in inspect.signature(VllmTrace.__init__).parameters if p != "self"]
    assert options and not [p for p in options if f"| `{p}` |" not in text]
    for method in ("capture", "capture_dummy", "reload", "generate"):
        params = [p for p in inspect.signature(getattr(VllmTrace, method)).parameters
                  if p != "self"]
        assert f"vt.{method}(" in text and all(p in text for p in params), method


# --------------------------------------------------------------------------- the README

def test_readme_is_a_short_front_door():
    text = README.read_text()
    assert len(text.splitlines()) < 150
    first = text.splitlines()[:5]
    assert first[:3] == ["# graphtrace", "", "```bash"]
    assert first[3].startswith("make demo ") and "`graphtrace demo`" in first[3]
    assert first[4].startswith("make test ") and "test suite" in first[4]
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t.*graphtrace demo$", make, re.M)
    assert re.search(r"^test: .*\n\t.*-m pytest", make, re.M)
    limits = section(text, "Limits that matter")
    assert "docs/gpu.md#results-on-an-h200" in limits and "CPU only" in limits


def _extras() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
               ["optional-dependencies"])


def test_readme_installs_only_extras_pyproject_defines():
    named = re.findall(r"pip install -e '?\.\[([\w,]+)\]", README.read_text())
    assert named
    for group in named:
        assert set(group.split(",")) <= _extras(), group


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is missing"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_anchor_links_name_real_headings(doc):
    for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", doc.read_text()):
        page = doc.parent / target if target else doc
        slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}
        assert anchor in slugs, f"{doc.name} links to {target}#{anchor}: no such heading"


def _parser_options() -> set[str]:
    import argparse

    from analysis import gpu_check
    from graphtrace import cli
    from graphtrace.demo import runner

    demo = argparse.ArgumentParser()
    runner.add_arguments(demo)
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = [demo, gpu_check.build_parser(), *sub.choices.values()]
    return {o for p in parsers for a in p._actions for o in a.option_strings}


@pytest.mark.parametrize("name", ["README.md", "cases.md", "reports.md", "gpu.md"])
def test_every_option_the_docs_name_exists(name):
    doc = README if name == "README.md" else ROOT / "docs" / name
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", doc.read_text()))
    assert named - {"--help"} <= _parser_options(), sorted(named - _parser_options())


def test_readme_example_runs(tmp_path, monkeypatch):
    """The README's example, with a tiny model, a copy-in-place reload and `out/` in tmp."""
    torch = pytest.importorskip("torch")
    code = re.search(r"```python\n(.*?)```", section(README.read_text(), "Example"), re.S).group(1)
    assert len(code.strip().splitlines()) <= 11
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    new = {k: v + 1 for k, v in model.state_dict().items()}

    def reload_weights(m):
        with torch.no_grad():
            m.load_state_dict(new)  # copies into the registered storages: nothing stale

    monkeypatch.chdir(tmp_path)
    scope = {"model": model, "x": torch.randn(3, 4), "reload_weights": reload_weights}
    with torch.no_grad():
        exec(compile(code, "README.md", "exec"), scope)
    report = scope["report"]
    assert len(report.edges) and report.stale.empty
    assert (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.slow
def test_readme_demo_table_is_what_the_demo_prints(capsys):
    """The closing table in the README is the default demo's own summary, line for line."""
    pytest.importorskip("torch")
    from graphtrace.demo import runner

    block = re.search(r"```\n(variant .*?)```", section(README.read_text(), "The demo"), re.S)
    table = block.group(1).rstrip("\n").splitlines()
    assert runner.main(["--device", "cpu", "--backend", "builtin", "--quiet", "--out", ""]) == 0
    printed = capsys.readouterr().out.splitlines()
    start = printed.index(table[0])
    assert printed[start:start + len(table)] == table


# -- Notes: `Note [name]` blocks, and citations `Note [name] in path` that must find them -------
_NOTE_SOURCES = [p for p in (*ROOT.joinpath("graphtrace").rglob("*"), *ROOT.joinpath(
    "analysis").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"), *DOCS)
    if p.suffix in (".py", ".md", ".cpp")]


def _note_name(raw: str) -> str:
    """A Note's name as written across lines: comment marks and string quotes dropped."""
    return " ".join(re.sub(r'(#|//|")', " ", raw).split())


def _notes_defined() -> dict[str, set[str]]:
    """Note name -> the files (relative paths) that hold its block: `Note [name]` alone on a
    line (in a comment, a docstring or a heading) with a line of ~ under it, or a `## Note`
    heading."""
    found: dict[str, set[str]] = {}
    for path in _NOTE_SOURCES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*(?:#+|//)?\s*Note \[([^\]]+)\]\s*$", line)
            under = lines[i + 1] if i + 1 < len(lines) else ""
            if m and (re.match(r"\s*(?:#|//)?\s*~~~", under) or line.startswith("## ")):
                found.setdefault(_note_name(m.group(1)), set()).add(
                    str(path.relative_to(ROOT)))
    return found


def test_every_note_citation_names_a_note_in_that_file():
    """A Note cited with the file it is in (graphtrace/..., docs/...): that file holds the
    Note's block, so a module split moves its citations along (issue 40)."""
    defined = _notes_defined()
    cite = re.compile(r"Note\s+\[([^\]]+)\][,:)`\s]{0,3}\s*in\s+`?((?:graphtrace|docs)/[\w/.]+?"
                      r"\.(?:py|md|cpp))")
    wrong = []
    for path in _NOTE_SOURCES:
        for m in cite.finditer(path.read_text()):
            name, where = _note_name(m.group(1)), m.group(2)
            if where not in defined.get(name, set()):
                wrong.append(f"{path.relative_to(ROOT)}: Note [{name}] in {where} "
                             f"(defined in: {sorted(defined.get(name, [])) or 'nowhere'})")
    assert len(defined) > 40 and not wrong, "\n".join(wrong)
