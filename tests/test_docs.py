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
