"""The package's layers use only each other's public surface (issue #13).

Read from the source with `ast`, so the test needs no torch: every `from graphtrace.X
import name` and every `graphtrace.X.name` / `alias.name` attribute read across modules
must name something public (no leading underscore), and every module's `__all__` lists
only public names it defines or imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "graphtrace"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


MODULES = dict(_modules())
_DEFINED: dict[str, set[str]] = {}


def _defined_private_attributes() -> dict[str, set[str]]:
    """Per layer: the private attribute names its classes define (methods, class
    attributes, `self._x = ...`, `__slots__` entries)."""
    out: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names = out.setdefault(_layer(module), set())
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self" \
                        and _private(node.attr):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and _private(node.value) and node.value.isidentifier():
                    names.add(node.value)  # __slots__ entries and the like
    return out



def _layer(module: str) -> str:
    """A layer is a top-level module or subpackage of graphtrace (graphtrace.report.io and
    graphtrace.report.core are one layer; graphtrace.vllm.plugin and .adapter another)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not MODULES[module].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _crossings(module: str, path: Path):
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    external: set[str] = set()  # names bound to other packages (torch._ops is torch's)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if not source.startswith("graphtrace"):
                external.update(a.asname or a.name for a in node.names)
                continue
            for a in node.names:
                target = f"{source}.{a.name}"
                if target in MODULES:  # a submodule imported by name
                    aliases[a.asname or a.name] = target
                    if _private(a.name) and _layer(target) != _layer(module):
                        yield node.lineno, f"imports private module {target}"
                elif _private(a.name) and _layer(source) != _layer(module):
                    yield node.lineno, f"imports private {a.name} from {source}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("graphtrace") and a.asname:
                    aliases[a.asname] = a.name
                elif not a.name.startswith("graphtrace"):
                    external.add(a.asname or a.name.split(".")[0])
    DEFINED = _DEFINED or _DEFINED.update(_defined_private_attributes()) or _DEFINED
    mine = DEFINED.get(_layer(module), set())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        if isinstance(node.value, ast.Name):
            target = aliases.get(node.value.id)
            if target and _layer(target) != _layer(module):
                yield node.lineno, f"reads private {target}.{node.attr}"
                continue
            if node.value.id in ("self", "cls") or node.value.id in external:
                continue
        # obj._name where _name belongs to another layer's classes (torch's own private
        # helpers, such as storage._cdata, are fine: they are not defined here)
        if node.attr not in mine:
            owners = sorted(layer for layer, names in DEFINED.items() if node.attr in names)
            if owners:
                yield node.lineno, f"reads {owners[0]}'s private attribute .{node.attr}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_layers(module):
    bad = [f"{MODULES[module].name}:{line}: {what}" for line, what in _crossings(module, MODULES[module])]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_all_lists_public_names_only(module):
    tree = ast.parse(MODULES[module].read_text())
    listed = None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                listed = [c.value for c in ast.walk(node.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    if module.endswith("__main__"):
        pytest.skip("a __main__ module is run, not imported")
    assert listed is not None, f"{module} has no __all__: list its public surface"
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.alias)):
            defined.add(node.id if isinstance(node, ast.Name) else (node.asname or node.name))
    missing = [n for n in listed if n not in defined and n != "__version__"]
    assert not missing, f"{module}.__all__ lists names it does not define: {missing}"
    private = [n for n in listed if _private(n)]
    assert not private, f"{module}.__all__ lists private names {private}"


# -- torch's private API goes through graphtrace._compat (issue 23, part 4) ----------------------
COMPAT = "graphtrace._compat"

# Private attributes of objects graphtrace does not define that modules other than _compat may
# read in place, each for a reason. Anything else private of torch's goes through _compat.
FOREIGN_PRIVATE_ALLOWED = {
    "_cdata": "a storage's StorageImpl address, read per tensor per op on the hot path (a call "
              "would cost more than the read); _compat checks it exists at import",
    "_version": "a tensor's version counter (what autograd reads): the freshness check compares "
                "it per source owner, a read, not a call",
    "_replace": "NamedTuple's public copy-with-changes method (the leading underscore is "
                "NamedTuple's convention, not privacy)",
    "_parameters": "nn.Module's registry of parameters: what 'registered' means (demo reload)",
    "_buffers": "nn.Module's registry of buffers (demo reload)",
    "_modules": "nn.Module's registry of submodules (the owner walk)",
    "_non_persistent_buffers_set": "nn.Module's registry (demo reload)",
    "_fields": "namedtuple's public field list (underscored to avoid clashes)",
    "_getframe": "sys._getframe, not torch",
    "_dummy_run": "vLLM's model runner warm-up, not torch (graphtrace.vllm); SGLang's runner's "
                  "dummy forward (graphtrace.sglang)",
    "_autotune_buffers": "SGLang's eager runner's decode-shaped dummy buffers, not torch "
                         "(graphtrace.sglang: the emulated decode graphs)",
    "_w1": "a demo case's own class attribute",
    "_w2": "a demo case's own class attribute",
}


# Uses in modules that another change owns now (issue 23, part 1: guard.py), to be routed
# through _compat there (`storage_from_weak_ref`). Tolerated until then; once gone, the test
# says to remove the entry.
PENDING: dict[str, set[str]] = {}


def _torch_private_path(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_private(p) for p in parts[1:])


def _attribute_chain(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def _private_torch_uses(module: str, path: Path):
    tree = ast.parse(path.read_text(), str(path))
    DEFINED = _DEFINED or _DEFINED.update(_defined_private_attributes()) or _DEFINED
    ours = set().union(*DEFINED.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _torch_private_path(node.module):
                yield node.lineno, f"imports from private {node.module}"
            elif node.module.split(".")[0] == "torch":
                for a in node.names:
                    if _private(a.name):
                        yield node.lineno, f"imports private {a.name} from {node.module}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _torch_private_path(a.name):
                    yield node.lineno, f"imports private {a.name}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _attribute_chain(node)
            if chain is not None and _torch_private_path(chain):
                yield node.lineno, f"reads {chain}"
            elif not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and node.attr not in ours and node.attr not in FOREIGN_PRIVATE_ALLOWED:
                yield node.lineno, f"reads a foreign private attribute .{node.attr}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != COMPAT))
def test_private_torch_api_only_through_compat(module):
    """No module but graphtrace._compat imports a private torch module or name, or reads a
    private attribute it does not define (FOREIGN_PRIVATE_ALLOWED lists the exceptions)."""
    found = list(_private_torch_uses(module, MODULES[module]))
    pending = PENDING.get(module, set())
    bad = [f"{MODULES[module].name}:{line}: {what}" for line, what in found if what not in pending]
    assert not bad, "route these through graphtrace._compat:\n" + "\n".join(bad)
    gone = pending - {what for _, what in found}
    assert not gone, f"routed now: remove {sorted(gone)} from PENDING[{module!r}]"


def test_the_private_torch_check_finds_what_it_looks_for(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import torch\nimport torch._dynamo\n"
                      "from torch.utils._pytree import tree_iter\n"
                      "from torch._C import _len_torch_dispatch_stack\n"
                      "from torch.utils import _python_dispatch\n"
                      "x = torch._C.ClassType\ny = s._weak_ref()\nz = s._cdata\n"
                      "w = self._anything\n")
    found = [what for _, what in _private_torch_uses("graphtrace.m", source)]
    assert found == ["imports private torch._dynamo", "imports from private torch.utils._pytree",
                     "imports from private torch._C", "imports private _python_dispatch from "
                     "torch.utils", "reads torch._C", "reads a foreign private attribute ._weak_ref"], found
# -- direction: the core below the session, the session below the integrations --------------

SESSION = {m for m in MODULES if m == "graphtrace.tracing" or m.startswith("graphtrace.tracing.")}
ABOVE_CORE = ("graphtrace.tracing", "graphtrace.cli", "graphtrace.__main__", "graphtrace.vllm",
              "graphtrace.sglang", "graphtrace.demo")
TRACE_INTERNALS = {"recorder", "owner_snapshot", "compiled_regions", "derived"}


def _all_imports(path: Path) -> set[str]:
    """Every module a file imports by absolute name, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _imported(path: Path) -> set[str]:
    """Every graphtrace module a file imports, at any depth (lazy imports included)."""
    return {m for m in _all_imports(path) if m == "graphtrace" or m.startswith("graphtrace.")}


def _is_core(module: str) -> bool:
    return module != "graphtrace" and not module.startswith(ABOVE_CORE) \
        and module not in ("graphtrace._lazy",)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _is_core(m)))
def test_the_core_never_imports_the_session_or_integrations(module):
    bad = sorted(m for m in _imported(MODULES[module])
                 if m in SESSION or m.startswith(("graphtrace.vllm", "graphtrace.demo",
                                                  "graphtrace.cli")))
    assert not bad, f"{module} (core) imports {bad}: hand it what it needs instead"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("graphtrace.vllm")))
def test_integrations_use_the_sessions_public_surface_only(module):
    """The vLLM adapter and plugin talk to a Trace through its public methods (`captures`,
    `models_changed`, `record_error`, `saw_compiled`, `guard`, `diff`, ...), never through
    the collaborators it is built from."""
    tree = ast.parse(MODULES[module].read_text())
    reads = sorted({f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and n.attr in TRACE_INTERNALS})
    assert not reads, f"{module} reads a trace's internals: {reads}"


def _import_edges() -> dict[str, set[str]]:
    """module -> the graphtrace modules it imports (lazy imports included; `from pkg import
    mod` counts as importing `pkg.mod`)."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        found = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        edges[module] = {m for m in found if m in MODULES and m != module}
    return edges


def _runtime_nodes(tree: ast.AST):
    """`ast.walk` without the bodies of `if TYPE_CHECKING:` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, targets in edges.items() for b in targets
                    if b != "graphtrace"])  # the package's lazy __init__ is no layer
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


# Import circles that still exist; a new circle fails the test, and so does one listed here
# that no longer exists. (The vLLM adapter/hooks/serve circle went with the serving core,
# issue #40: the hooks hand the engine's points to serve through `hooks.serve_through`.)
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    assert _import_cycles(_import_edges()) == KNOWN_CYCLES


def test_the_cycle_check_finds_a_cycle():
    edges = {"graphtrace.a": {"graphtrace.b"}, "graphtrace.b": {"graphtrace.a"},
             "graphtrace.c": {"graphtrace.a"}}
    assert _import_cycles(edges) == [["graphtrace.a", "graphtrace.b"]]


# -- the serving core and its engine adapters (issue #40, item 2; docs/internals.md) ----------
# The core owns check before serve for any engine; an adapter supplies the engine's side and
# uses only the core's public surface (its __all__); the core imports no engine.
SERVING = "graphtrace.serving"
ADAPTERS = ("graphtrace.vllm", "graphtrace.sglang")
ENGINES = ("vllm", "sglang", "tensorrt_llm", "lmdeploy")


def _listed(path: Path) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return set()


def _serving_names(path: Path, surface: set[str]):
    """(line, name) for every name an adapter takes from the serving core outside
    ``surface``: imported from it, or read as an attribute of the module."""
    tree = ast.parse(path.read_text(), str(path))
    bound = {SERVING}  # names (or dotted chains) that are the serving module here
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == SERVING:
            for a in node.names:
                if a.name not in surface:
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "graphtrace":
            bound.update(a.asname or a.name for a in node.names if a.name == "serving")
        elif isinstance(node, ast.Import):
            bound.update(a.asname for a in node.names if a.name == SERVING and a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _attribute_chain(node.value) in bound \
                and node.attr not in surface:
            yield node.lineno, node.attr


def _engine_imports(path: Path) -> set[str]:
    """The engines and engine adapters a file imports."""
    return {m for m in _all_imports(path) if m.split(".")[0] in ENGINES or m.startswith(ADAPTERS)}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(ADAPTERS)))
def test_adapters_use_only_the_serving_cores_public_surface(module):
    surface = _listed(MODULES[SERVING])
    bad = [f"line {line}: {name}" for line, name in _serving_names(MODULES[module], surface)]
    assert not bad, f"{module} uses names of {SERVING} outside its __all__: {bad}"


def test_the_serving_core_imports_no_engine():
    assert not _engine_imports(MODULES[SERVING])
    assert not _imported(MODULES[SERVING]) & (SESSION | {"graphtrace"})


def test_the_serving_checks_find_what_they_look_for(tmp_path):
    adapter = tmp_path / "adapter.py"
    adapter.write_text("import graphtrace.serving as core\n"
                       "from graphtrace import serving\n"
                       "from graphtrace.serving import ServingCore, _cores\n"
                       "core.strict()\ncore._lock\nserving.pending()\nserving._any\n"
                       "graphtrace.serving.logger\n")
    surface = _listed(MODULES[SERVING])
    assert [n for _, n in _serving_names(adapter, surface)] == ["_cores", "_lock", "_any",
                                                                "logger"]
    core = tmp_path / "core.py"
    core.write_text("import vllm.distributed\nfrom sglang.srt import x\nimport torch\n"
                    "from graphtrace.vllm import hooks\n")
    assert _engine_imports(core) == {"vllm.distributed", "sglang.srt", "graphtrace.vllm"}
