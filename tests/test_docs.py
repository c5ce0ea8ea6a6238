"""The docs list the words and columns graphtrace.vocab defines, no more, no fewer, in order."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrace import vocab

ROOT = Path(__file__).resolve().parents[1]
INTERNALS = ROOT / "docs" / "internals.md"
README = ROOT / "README.md"


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


@pytest.mark.parametrize("doc", [INTERNALS, README], ids=["internals", "readme"])
def test_layout_tables_name_every_module(doc):
    layout = section(doc.read_text(), "Layout")
    missing = [entry for entry in _package_entries() if f"`{entry}`" not in layout]
    assert not missing, f"{doc.name}'s Layout table does not name {missing}"
    for named in re.findall(r"`(graphtrace/[\w/.]+)`", layout):
        assert (ROOT / named).exists(), f"{doc.name}'s Layout names {named}, which does not exist"


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


def test_readme_names_every_variable_the_vllm_package_reads():
    files = sorted((ROOT / "graphtrace" / "vllm").glob("*.py")) + [
        ROOT / "graphtrace" / "provenance.py"]  # the plugin's trace reads it
    read = set().union(*(_env_reads(f) for f in files))
    assert {"GRAPHTRACE_VLLM", "GRAPHTRACE_VLLM_DIR", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "GRAPHTRACE_PROVENANCE"} <= read  # the scan sees constants and literals
    text = section(README.read_text(), "Inside a real vLLM")
    missing = sorted(v for v in read if f"`{v}`" not in text)
    assert not missing, f"README's vLLM section does not name {missing}"


def test_readme_documents_every_trace_llm_option():
    import inspect

    from graphtrace.vllm.adapter import VllmTrace

    text = section(README.read_text(), "Inside a real vLLM")
    options = [p for p in inspect.signature(VllmTrace.__init__).parameters if p != "self"]
    assert options and not [p for p in options if f"| `{p}` |" not in text]
    for method in ("capture", "capture_dummy", "reload", "generate"):
        params = [p for p in inspect.signature(getattr(VllmTrace, method)).parameters
                  if p != "self"]
        assert f"vt.{method}(" in text and all(p in text for p in params), method
