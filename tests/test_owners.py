"""Owner walk: exact paths for every kind of holder, round trips through resolve_path."""

from __future__ import annotations

import collections
import functools
import types
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import graphtrace as gt
from graphtrace.owners import PathSet, resolve_path, walk_owners


def _permute(x, perm):
    return x[:, perm]


@dataclass
class Cfg:
    scale: torch.Tensor
    name: str = "cfg"


class Helper:
    def __init__(self, t):
        self.t = t

    def run(self, x):
        return x * self.t


class Slotted:
    __slots__ = ("a", "__hidden", "unset")

    def __init__(self, a, hidden):
        self.a = a
        self.__hidden = hidden


Pair = collections.namedtuple("Pair", "lo hi")


def _with_empty_cell():
    def inner():
        return later  # noqa: F821 - bound after return: the cell stays empty

    return inner
    later = 1  # noqa: F841


class Kernel:
    """A kernel-like plain object, as a quantisation method keeps after loading weights."""

    def __init__(self, weight, perm, extra, default, kwdefault, table, item, scale, helper):
        self.act_perm = functools.partial(_permute, perm=perm)
        self.mm = functools.partial(torch.mm, weight)  # a registered parameter, owned again
        self.gather = lambda x: x[:, extra]
        self.empty_cell = _with_empty_cell()

        def scaled(x, s=default, *, bias=kwdefault):
            return x * s + bias

        self.scaled = scaled
        self.tables = {"zeros": table, 3: table, ("a", 1): item, "ints": [1, 2, 3]}
        self.chunks = [item, 5, "s"]
        self.cfg = Cfg(scale=scale)
        self.run = helper.run  # bound method of a plain object: walk its __self__
        self.me = self  # cycle through an object


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("running", torch.zeros(4))
        self.t = {name: torch.full((4,), float(i)) for i, name in enumerate(
            ["perm", "extra", "default", "kwdefault", "table", "item", "scale", "helper"])}
        self.kernel = Kernel(self.linear.weight, self.t["perm"], self.t["extra"],
                             self.t["default"], self.t["kwdefault"], self.t["table"],
                             self.t["item"], self.t["scale"], Helper(self.t["helper"]))
        self.fwd = self.linear.forward  # bound method of a module: modules are walked by name


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.block = Block()
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied: both names are owners
        object.__setattr__(self.block, "parent", self)  # a module's parent as a plain attribute
        self.hook_t = torch.ones(1)
        self.block.register_forward_hook(functools.partial(lambda m, i, o, t: o, t=self.hook_t))


K = "block.kernel"
EXPECTED = {
    ("embed.weight", "parameter"),
    ("block.linear.weight", "parameter"),
    ("block.linear.bias", "parameter"),
    ("head.weight", "parameter"),
    ("block.running", "buffer"),
    ("hook_t", "attribute"),
    *((f"block.t['{n}']", "attribute") for n in
      ["perm", "extra", "default", "kwdefault", "table", "item", "scale", "helper"]),
    (f"{K}.act_perm.keywords['perm']", "attribute"),
    (f"{K}.mm.args[0]", "attribute"),
    (f"{K}.gather.__closure__['extra']", "attribute"),
    (f"{K}.scaled.__defaults__[0]", "attribute"),
    (f"{K}.scaled.__kwdefaults__['bias']", "attribute"),
    (f"{K}.tables['zeros']", "attribute"),
    (f"{K}.tables[3]", "attribute"),
    (f"{K}.tables[('a', 1)]", "attribute"),
    (f"{K}.chunks[0]", "attribute"),
    (f"{K}.cfg.scale", "attribute"),
    (f"{K}.run.__self__.t", "attribute"),
}


def owners(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reference model must walk without cuts
        return list(walk_owners(model, **kw))


def test_exact_paths_and_kinds():
    model = Model()
    got = owners(model)
    assert len(got) == len(set((p, k) for p, k, _ in got)), "no path is yielded twice"
    assert {(p, k) for p, k, _ in got} == EXPECTED


def test_registered_names_match_torch_in_order():
    model = Model()
    got = owners(model)
    params = [(p, t) for p, k, t in got if k == "parameter"]
    buffers = [(p, t) for p, k, t in got if k == "buffer"]
    assert [p for p, _ in params] == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert [p for p, _ in buffers] == [n for n, _ in model.named_buffers(remove_duplicate=False)]
    tied = dict(params)
    assert tied["embed.weight"] is tied["head.weight"]
    assert [k for _, k, _ in got] == sorted((k for _, k, _ in got),
                                            key=["parameter", "buffer", "attribute"].index)


def test_attribute_owners_are_the_tensors_held():
    model = Model()
    found = {p: t for p, _, t in owners(model)}
    b = model.block
    assert found[f"{K}.mm.args[0]"] is b.linear.weight  # registered, and owned by the partial too
    assert isinstance(found[f"{K}.mm.args[0]"], nn.Parameter)
    assert found[f"{K}.act_perm.keywords['perm']"] is b.t["perm"]
    assert found[f"{K}.gather.__closure__['extra']"] is b.t["extra"]
    assert found[f"{K}.tables[3]"] is found[f"{K}.tables['zeros']"] is b.t["table"]
    assert found["hook_t"] is model.hook_t


def test_resolve_round_trips_every_path():
    model = Model()
    for path, _, t in owners(model):
        assert resolve_path(model, path) is t, path


def test_resolve_after_rebind_and_orphaning():
    model = Model()
    k = model.block.kernel
    new_perm = torch.arange(4)
    k.act_perm = functools.partial(_permute, perm=new_perm)  # rebound: resolves to the new one
    assert resolve_path(model, f"{K}.act_perm.keywords['perm']") is new_perm
    k.act_perm = functools.partial(_permute)  # keyword gone
    k.gather = lambda x: x  # closure gone
    del k.tables["zeros"]
    k.chunks.clear()
    k.cfg = None
    del model.block.linear.bias
    model.block.linear.bias = None
    for path in [f"{K}.act_perm.keywords['perm']", f"{K}.gather.__closure__['extra']",
                 f"{K}.tables['zeros']", f"{K}.chunks[0]", f"{K}.cfg.scale",
                 "block.linear.bias", "no_such.attr", f"{K}.tables['ints']", "block.linear"]:
        assert resolve_path(model, path) is None, path  # missing, or not a tensor any more


def test_resolve_does_not_insert_into_defaultdicts():
    model = nn.Module()
    model.d = collections.defaultdict(list)
    assert resolve_path(model, "d['x']") is None
    assert dict(model.d) == {}


def test_malformed_path_and_non_module_arguments():
    model = Model()
    # "[01]", "[-01]", a raw newline in a quoted key: not Python literals (owners._literal
    # reads the common keys without the parser; what it does not read, ast.literal_eval does)
    for bad in ["", "a..b", "a[0", "a['x'", "a]b[0]x", "d[01]", "d[-01]", "d['a\nb']"]:
        with pytest.raises(ValueError):
            resolve_path(model, bad)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        walk_owners({"w": torch.ones(1)})  # raised at the call, before iteration
    with pytest.raises(TypeError, match="torch.nn.Module"):
        resolve_path(torch.ones(1), "x")
    with pytest.raises(ValueError):
        walk_owners(model, max_depth=0)


def test_hooks_and_module_internals_give_no_paths():
    model = nn.Linear(2, 2)
    t = torch.ones(1)
    model.register_forward_hook(functools.partial(lambda m, i, o, t: o, t=t))
    model.register_forward_pre_hook(lambda m, i: i)
    model.register_full_backward_hook(lambda *a, t=t: None)
    model.register_load_state_dict_post_hook(lambda *a, t=t: None)
    assert [p for p, _, _ in owners(model)] == ["weight", "bias"]


def test_cycles_shared_objects_and_shared_modules():
    model = nn.Module()
    model.a = nn.Linear(1, 1)
    model.b = nn.Linear(1, 1)
    shared = types.SimpleNamespace(t=torch.ones(1))
    shared.self_ref = shared
    shared.items = [shared, {"back": shared}]
    model.a.kernel = shared
    model.b.kernel = shared  # one object, two holders: both paths are owners
    model.c = model.a  # one module under two names: registered and attribute paths for both
    object.__setattr__(model.a, "root", model)
    paths = [p for p, k, _ in owners(model) if k == "attribute"]
    assert sorted(paths) == ["a.kernel.t", "b.kernel.t", "c.kernel.t"]


def test_more_holders():
    model = nn.Module()
    t = {n: torch.full((1,), float(i)) for i, n in enumerate("abcdefgh")}
    model.nt = Pair(t["a"], 1)
    model.slotted = Slotted(t["b"], t["c"])
    model.ns = types.SimpleNamespace(inner={"k": (t["d"],)})
    model.method = t["e"].mul_  # a builtin method holds its tensor
    model.wrapped = functools.wraps(lambda: None)(functools.partial(torch.add, t["f"]))
    model.a_set = {t["g"]}  # sets have no path: not walked
    v = t["h"]
    model.nested = functools.partial(lambda x: x + v, 1)
    got = {p: x for p, _, x in owners(model)}
    assert got == {
        "nt.lo": t["a"],
        "slotted.a": t["b"],
        "slotted._Slotted__hidden": t["c"],
        "ns.inner['k'][0]": t["d"],
        "method.__self__": t["e"],
        "wrapped.args[0]": t["f"],
        "nested.func.__closure__['v']": t["h"],
    }
    for path, x in got.items():
        assert resolve_path(model, path) is x, path


def test_empty_meta_and_subclass_tensors_are_yielded():
    model = nn.Module()
    model.meta = torch.empty(3, device="meta")
    model.empty = torch.empty(0)
    model.param = nn.Parameter(torch.ones(1))
    model.holder = types.SimpleNamespace(p=model.param)
    got = {p: k for p, k, _ in owners(model)}
    assert got == {"param": "parameter", "meta": "attribute", "empty": "attribute",
                   "holder.p": "attribute"}


def test_bounds_warn_and_cut():
    model = nn.Module()
    deep = leaf = {}
    for _ in range(20):
        leaf["x"] = {}
        leaf = leaf["x"]
    leaf["t"] = torch.ones(1)
    model.deep = deep
    model.big = list(range(50)) + [torch.ones(1)]
    model.odd_keys = {torch.float16: torch.ones(1)}
    with pytest.warns(RuntimeWarning) as rec:
        got = [p for p, _, _ in walk_owners(model, max_items=40)]
    assert got == []
    text = str(rec[0].message)
    for what in ["deeper than max_depth", "container longer than max_items",
                 "dict key that is not a literal"]:
        assert what in text
    assert len(rec) == 1
    with pytest.warns(RuntimeWarning, match="not a literal"):
        got = [p for p, _, _ in walk_owners(model, max_depth=30, max_items=1000)]
    assert got == ["deep" + "['x']" * 20 + "['t']", "big[50]"]


def test_a_dict_key_that_is_no_literal_cuts_only_where_a_tensor_lies_beyond_it():
    """SGLang's layer boundaries keep a plan keyed by an Enum that holds no tensor
    (``attn_boundary.plan.edges[BatchVariant.ORDINARY]``): nothing is cut there, so no
    blind spot; the same key in front of a tensor (even deep in an object) still is one."""
    import enum
    import warnings

    class Variant(enum.Enum):
        ORDINARY = 1

    model = nn.Module()
    def adapter(x):  # a plain function: no closure, no defaults
        return x

    model.plan = types.SimpleNamespace(edges={Variant.ORDINARY: types.SimpleNamespace(
        layout=("rows", 4), need={"read": [1, 2]}, adapter=adapter)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(walk_owners(model)) == []
    for holds in ([torch.ones(1)], functools.partial(adapter, torch.ones(1)),
                  (lambda t: lambda x: x * t)(torch.ones(1))):  # in a closure
        model.plan.edges[Variant.ORDINARY].need["scale"] = holds
        with pytest.warns(RuntimeWarning, match="not a literal"):
            assert list(walk_owners(model)) == []


def test_budget_exhaustion_warns():
    model = nn.Module()
    model.objs = [types.SimpleNamespace(t=torch.ones(1)) for _ in range(10)]
    with pytest.warns(RuntimeWarning, match="past max_items"):
        got = list(walk_owners(model, max_items=15))
    assert 0 < len(got) < 10


def test_odd_dict_keys_round_trip():
    model = nn.Module()
    keys = ["a]b", "it's", 'q"', "x.y[0]", -1, True, None, 0.5, ("t", (1, 2))]
    model.d = {k: torch.full((1,), float(i)) for i, k in enumerate(keys)}
    got = owners(model)
    assert len(got) == len(keys)
    for path, _, t in got:
        assert resolve_path(model, path) is t, path
    # keys spelled as Python reads them, not as repr writes them, resolve as literals do
    model.d = {10: torch.ones(1), -10: torch.zeros(1), "a\tb": torch.ones(2), False: torch.ones(3)}
    assert resolve_path(model, "d[1_0]") is model.d[10]
    assert resolve_path(model, "d[ -10 ]") is model.d[-10]
    assert resolve_path(model, "d['a\tb']") is model.d["a\tb"]
    assert resolve_path(model, 'd["a\\tb"]') is model.d["a\tb"]
    assert resolve_path(model, "d[False]") is model.d[False]
    assert resolve_path(model, "d[0]") is model.d[False]  # 0 == False, one dict entry


class Hostile:
    @property
    def __dict__(self):
        raise RuntimeError("no")


def test_an_object_that_raises_is_noted_and_the_walk_goes_on():
    model = nn.Module()
    model.bad = Hostile()
    model.good = types.SimpleNamespace(t=torch.ones(1))
    with pytest.warns(RuntimeWarning, match="object that raised RuntimeError"):
        got = [p for p, _, _ in walk_owners(model)]
    assert got == ["good.t"]


def test_path_set_resolves_as_resolve_path_does():
    """PathSet (shared prefixes followed once) answers every path as resolve_path does:
    before and after rebinds and orphaning, with [1] / [True] / [1.0] keys kept apart."""
    model = Model()
    model.d = {1: torch.ones(1), 1.5: torch.ones(2), "1": torch.ones(3)}
    # d[True] finds d[1] (True == 1: one dict entry); still two distinct path steps
    paths = [p for p, _, _ in owners(model)] + [
        "d[1]", "d[True]", "d[1.5]", "d['1']", "no_such.attr", "block.linear",
        f"{K}.tables['ints']", "d[2]"]
    paths_set = PathSet(paths)
    assert len(paths_set) == len(paths)

    def same():
        got = paths_set.resolve(model)
        want = [resolve_path(model, p) for p in paths]
        assert [id(t) for t in got] == [id(t) for t in want]
        return got

    before = same()
    assert before[paths.index("d[1.5]")] is model.d[1.5]
    k = model.block.kernel
    k.act_perm = functools.partial(_permute, perm=torch.arange(4))  # rebound
    k.gather = lambda x: x  # closure gone
    del k.tables["zeros"]
    model.block.linear.bias = None
    after = same()
    assert sum(t is None for t in after) > sum(t is None for t in before)
    assert after[paths.index(f"{K}.act_perm.keywords['perm']")] is k.act_perm.keywords["perm"]
    with pytest.raises(TypeError, match="torch.nn.Module"):
        paths_set.resolve({"not": "a module"})
    with pytest.raises(ValueError):
        PathSet(["a..b"])


MUTATIONS = {
    "nothing": lambda m: None,
    "copy_ in place": lambda m: m.block.linear.weight.data.copy_(torch.randn(4, 4)),
    "parameter rebound": lambda m: setattr(m.block.linear, "weight",
                                           nn.Parameter(torch.randn(4, 4))),
    ".data swapped": lambda m: setattr(m.block.linear.weight, "data", torch.randn(4, 4)),
    "buffer rebound": lambda m: setattr(m.block, "running", torch.ones(4)),
    "module replaced": lambda m: setattr(m, "head", nn.Linear(4, 8, bias=False)),
    "parameter set to None": lambda m: setattr(m.block.linear, "bias", None),
    "partial rebound": lambda m: setattr(m.block.kernel, "act_perm",
                                         functools.partial(_permute, perm=torch.arange(4))),
    "dict entry rebound": lambda m: m.block.t.__setitem__("table", torch.zeros(4)),
    "same tensor, now a plain attribute": lambda m: _unregister_keep(m.block.linear, "bias"),
}


def _unregister_keep(module, name):
    tensor = module._parameters.pop(name)
    module.__dict__[name] = tensor  # no longer in the registry, same storage: not moved


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_moved_agrees_with_resolving_every_path(mutation):
    """PathSet.moved (the capture-end check: registry and dict-key steps in C++, the rest in
    Python) says what comparing each resolved path's storage says, with and without native."""
    from graphtrace import native

    lib = native.load(required=False)
    model = Model()
    model.block.t = dict(model.block.t)  # a dict of tensors as a plain attribute of a module
    paths = [p for p, _, _ in owners(model)]
    before = [resolve_path(model, p).untyped_storage()._cdata for p in paths]
    python_set, native_set = PathSet(paths), PathSet(paths)
    python_set.resolve(model)  # registries learned, as the snapshot does after a walk
    native_set.resolve(model)
    assert not python_set.moved(model, before) and not native_set.moved(model, before, lib)
    MUTATIONS[mutation](model)
    now = [resolve_path(model, p) for p in paths]
    want = any(t is None or t.untyped_storage()._cdata != c for t, c in zip(now, before))
    assert want == (mutation not in ("nothing", "copy_ in place",
                                     "same tensor, now a plain attribute"))
    assert python_set.moved(model, before) == want
    if lib is not None:
        assert native_set.moved(model, before, lib) == want
        assert lib.paths_moved(model, nn.Module, nn.Parameter, [], [], []) == []
        with pytest.raises(TypeError, match="paths_moved"):
            lib.paths_moved(model, nn.Module, nn.Parameter, [], [0], [])


def test_a_grown_path_set_answers_as_one_made_at_once():
    """PathSet.add (the owner snapshot grows its set as captures match new paths, instead of
    parsing every path again): resolve and moved answer as for a set made from all the
    paths, in the order added, repeats kept."""
    from graphtrace import native

    lib = native.load(required=False)
    model = Model()
    paths = [p for p, _, _ in owners(model)]
    grown = PathSet(paths[:2])
    grown.add(paths[2:])
    grown.add(paths[:1])  # a repeat: one more answer, as the list says
    whole = PathSet(paths + paths[:1])
    assert grown.paths == whole.paths and len(grown) == len(paths) + 1
    assert [id(t) for t in grown.resolve(model)] == [id(t) for t in whole.resolve(model)]
    before = [resolve_path(model, p).untyped_storage()._cdata for p in grown.paths]
    for lib_or_none in (None, lib) if lib is not None else (None,):
        assert not grown.moved(model, before, lib_or_none)
    model.block.linear.weight = nn.Parameter(torch.zeros(4, 4))
    for lib_or_none in (None, lib) if lib is not None else (None,):
        assert grown.moved(model, before, lib_or_none) and whole.moved(model, before, lib_or_none)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_moved_with_versions_also_compares_version_counters(mutation):
    """PathSet.moved(..., versions=): a path reaching the same storage through a tensor whose
    version counter differs counts as moved too (the guard's freshness fast path), the same
    with and without native; None in `versions` leaves that path's counter uncompared."""
    from graphtrace import native

    lib = native.load(required=False)
    model = Model()
    model.block.t = dict(model.block.t)
    paths = [p for p, _, _ in owners(model)]
    before = [resolve_path(model, p).untyped_storage()._cdata for p in paths]
    versions = [resolve_path(model, p)._version for p in paths]
    MUTATIONS[mutation](model)
    now = [resolve_path(model, p) for p in paths]
    want = any(t is None or t.untyped_storage()._cdata != c or t._version != v
               for t, c, v in zip(now, before, versions))
    # `.data.copy_` writes through a tensor with a counter of its own: no version moves
    assert want == (mutation not in ("nothing", "copy_ in place",
                                     "same tensor, now a plain attribute"))
    libs = (None, lib) if lib is not None else (None,)
    for lib_or_none in libs:
        assert PathSet(paths).moved(model, before, lib_or_none, versions) == want
    if not want:  # an in-place write through the parameter itself moves its counter only
        with torch.no_grad():
            model.block.linear.weight.add_(1)
        for lib_or_none in libs:
            assert PathSet(paths).moved(model, before, lib_or_none, versions)
            assert not PathSet(paths).moved(model, before, lib_or_none, [None] * len(paths))
    if lib is not None:
        with pytest.raises(TypeError, match="paths_moved"):
            lib.paths_moved(model, nn.Module, nn.Parameter, [], [], [], [0])


# (how the owner of `w`, a (4, 8) float32 parameter, is bound again on its own storage) ->
# whether that is another view (Note [re-laid views] in graphtrace/verdict.py)
RELAYS = {
    "as at capture, a new tensor": ((torch.float32, (4, 8), (8, 1), 0), False),
    "another shape": ((torch.float32, (8, 4), (4, 1), 0), True),
    "transposed strides": ((torch.float32, (4, 8), (1, 4), 0), True),
    "another dtype": ((torch.int32, (4, 8), (8, 1), 0), True),
    "another offset": ((torch.float32, (4, 7), (8, 1), 1), True),
    "a length-one dimension's stride only": ((torch.float32, (1, 8), (99, 1), 0), False),
}


@pytest.mark.parametrize("relay", sorted(RELAYS))
def test_moved_with_views_compares_each_tensors_view(relay):
    """PathSet.moved(..., views=) (the guard's clean check): a parameter bound again on its
    captured storage under another view counts as moved, the same with and without native;
    the native pass flags such a leaf itself (left to Python's exact rule, not passed), and
    passes a leaf whose geometry is exactly as it was."""
    from graphtrace import native
    from graphtrace.verdict import View

    lib = native.load(required=True)
    m = nn.Module()
    shape = (1, 8) if "length-one" in relay else (4, 8)
    m.w = nn.Parameter(torch.rand(shape), requires_grad=False)
    m.b = nn.Parameter(torch.rand(8), requires_grad=False)
    paths = ["w", "b"]
    before = [t.untyped_storage()._cdata for t in (m.w, m.b)]
    views = [View.of(m.w), View.of(m.b)]
    nodes = PathSet(paths)
    assert not nodes.moved(m, before, None, None, views)
    assert not nodes.moved(m, before, lib, None, views)
    (dtype, size, stride, offset), relaid = RELAYS[relay]
    m.w.data = torch.empty(0, dtype=dtype).set_(m.w.untyped_storage(), offset, size, stride)
    for lib_or_none in (None, lib):
        assert nodes.moved(m, before, lib_or_none, None, views) == relaid
        assert not nodes.moved(m, before, lib_or_none)  # storages only: held
    # the native pass itself: the leaf is flagged (undecided) wherever the geometry differs
    exact = View.of(m.w) == views[0]
    args = (m, nn.Module, nn.Parameter, nodes._native_nodes, nodes._leaves, before)
    assert lib.paths_moved(*args, None, views) == ([] if exact else [0])
    assert lib.paths_moved(*args) == [] and lib.paths_moved(*args, None, None) == []
    with pytest.raises(TypeError, match="a view is"):
        lib.paths_moved(*args, None, [(torch.float32, [4, 8], (8, 1), 0), None])
    with pytest.raises(TypeError, match="paths_moved"):
        lib.paths_moved(*args, None, [None])


# --------------------------------------------------------------------------- opaque handles

def _prepacked(seed: int) -> torch.ScriptObject:
    """A `torch.classes.quantized.LinearPackedParamsBase` (packed int8 weights, CPU)."""
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        qw = torch.quantize_per_tensor(torch.rand(4, 4, generator=g), 0.01, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qw, torch.zeros(4))


class PackedKernel:
    """A kernel object keeping packed weights as a quantization method does: bound into a
    partial, in a dict, and a spare one in a list that no forward reads."""

    def __init__(self, packed: torch.ScriptObject, spare: torch.ScriptObject):
        self.apply = functools.partial(torch.ops.quantized.linear_dynamic, W_prepack=packed)
        self.by_name = {"w": packed}
        self.spares = [spare]


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
            self.fc = torch.ao.quantization.quantize_dynamic(
                nn.Sequential(nn.Linear(4, 4)), {nn.Linear}, dtype=torch.qint8)[0]
        self.kernel = PackedKernel(_prepacked(1), _prepacked(2))

    def forward(self, x):
        return self.fc(x) + self.kernel.apply(x)


PACKED = {"fc._packed_params._packed_params", "kernel.apply.keywords['W_prepack']",
          "kernel.by_name['w']", "kernel.spares[0]"}


def test_script_objects_are_owned_as_attributes_and_resolve_to_themselves():
    """Opaque handles (Note [opaque handles]) are walked like tensors wherever they are held:
    kind attribute, each path resolving (resolve_path, PathSet) to the very object."""
    model = Packed()
    found = [(p, k, t) for p, k, t in owners(model) if isinstance(t, torch.ScriptObject)]
    assert {(p, k) for p, k, _ in found} == {(p, "attribute") for p in PACKED}
    by_path = {p: t for p, _, t in found}
    assert by_path["fc._packed_params._packed_params"] is model.fc._packed_params._packed_params
    assert by_path["kernel.apply.keywords['W_prepack']"] is by_path["kernel.by_name['w']"]
    paths = sorted(PACKED)
    assert [resolve_path(model, p) for p in paths] == [by_path[p] for p in paths]
    assert PathSet(paths).resolve(model) == [by_path[p] for p in paths]
    model.kernel.by_name["w"] = _prepacked(3)  # rebound: the path reaches the new object
    assert resolve_path(model, "kernel.by_name['w']") is model.kernel.by_name["w"]
    model.kernel.spares.clear()
    assert resolve_path(model, "kernel.spares[0]") is None  # orphaned


@pytest.mark.parametrize("mutation", ["nothing", "repacked in the dict", "fc repacked"])
def test_moved_follows_script_objects_with_and_without_native(mutation):
    """PathSet.moved compares an opaque handle by its proxy storage (one per underlying
    object), in Python and through the native fast path alike."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from graphtrace import native
    from graphtrace.opaque import storage_of

    lib = native.load(required=False)
    model = Packed()
    paths = sorted(PACKED)
    # weak handles keep each proxy's address unique while they are compared against, as
    # the owner snapshot's walk handles do (a freed proxy's address is handed out again)
    handles = [StorageWeakRef(storage_of(resolve_path(model, p))) for p in paths]
    before = [h.cdata for h in handles]
    python_set, native_set = PathSet(paths), PathSet(paths)
    python_set.resolve(model)
    native_set.resolve(model)
    assert not python_set.moved(model, before)
    if lib is not None:
        assert not native_set.moved(model, before, lib)
    if mutation == "repacked in the dict":
        model.kernel.by_name["w"] = _prepacked(3)
    elif mutation == "fc repacked":
        fc = model.fc
        fc._packed_params._packed_params = _prepacked(4)
    want = mutation != "nothing"
    assert python_set.moved(model, before) == want
    if lib is not None:
        assert native_set.moved(model, before, lib) == want


def test_script_object_owners_in_a_report_through_the_public_api():
    """gt.trace + gt.capture: the packed objects a graph reads are storages (device opaque)
    owned by their attribute paths; a rebound holder makes its edge diverged."""
    import graphtrace as gt

    model = Packed()
    x = torch.rand(2, 4)
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(x)
    report = t.diff()
    o = report.owners
    s = report.storages
    s = s[s["device"].astype(str) == "opaque"]
    opaque = set(s["storage_id"])
    assert len(opaque) == 2 and set(s["nbytes"]) == {0}
    rows = o[o["storage_id"].isin(opaque)]
    assert set(zip(rows["path"].astype(str), rows["kind"].astype(str),
                   rows["status"].astype(str))) == {
        (p, "attribute", "holds") for p in PACKED - {"kernel.spares[0]"}}  # the spare: unread
    assert rows.groupby("storage_id")["path"].nunique().sort_values().tolist() == [1, 2]
    e = report.edges
    assert set(e.loc[e["storage_id"].isin(opaque), "verdict"].astype(str)) == {"stable"}

    model.kernel.apply = functools.partial(torch.ops.quantized.linear_dynamic,
                                           W_prepack=_prepacked(5))  # by_name keeps the old
    e = t.diff().edges
    e = e[e["storage_id"].isin(opaque)].set_index("owners")
    assert str(e.loc["fc._packed_params._packed_params", "verdict"]) == "stable"
    both = "; ".join(sorted(PACKED - {"kernel.spares[0]", "fc._packed_params._packed_params"}))
    assert str(e.loc[both, "verdict"]) == "diverged", e[["verdict"]]
    del g


# -- module graphs torch can build, and walks that fail in a diff ------------------------------

class Child(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return x * self.weight


class Parent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.child = Child()
        self.child.parent = self  # registered both ways: a cycle through _modules
        self.bias = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return self.child(x) + self.bias


@pytest.mark.usefixtures("writer")
def test_a_cycle_through_registered_children_is_walked_and_diffed():
    model = Parent()
    with pytest.raises(RecursionError):  # what torch itself does with it
        list(model.named_parameters(remove_duplicate=False))
    with gt.trace(model, strict=True) as t:
        with gt.capture("g") as g:
            model(torch.rand(4))
    from graphtrace.owners import walk_owners

    paths = {p for p, k, _ in walk_owners(model) if k == "parameter"}
    assert paths == {"bias", "child.weight"}  # the way back up is not entered again
    model.child.weight = torch.nn.Parameter(torch.rand(4))  # rebound: the graph reads old
    report = t.diff()
    assert report.meta["n_errors"] == 0
    e = report.edges.set_index("owners")
    assert e.loc["child.weight", "verdict"] == "stale"
    assert e.loc["bias", "verdict"] == "stable"
    assert len(g)


class BreaksAfterCapture(torch.nn.Module):
    """A module whose registries break after the capture (a walk that raises)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4))
        self.broken = False

    def forward(self, x):
        return x * self.weight

    def __getattr__(self, name):
        if name == "_modules" and self.__dict__.get("broken"):
            raise RuntimeError("hostile registry")
        return super().__getattr__(name)


@pytest.mark.usefixtures("writer")
def test_a_walk_that_fails_in_diff_is_a_counted_error_not_an_exception():
    model = BreaksAfterCapture()
    with gt.trace(model) as t:
        with gt.capture("g"):
            model(torch.rand(4))
    old = model.weight
    model.weight = torch.nn.Parameter(torch.rand(4))  # rebound: the diff must walk again
    model.broken = True
    model.__dict__["_modules"] = None  # named_modules now raises inside that walk
    del model.__dict__["_modules"]
    report = t.diff()
    assert report.meta["n_errors"] >= 1
    assert any("owner" in e["where"] for e in report.meta["errors"])
    e = report.edges.set_index("owners")
    assert e.loc["weight", "verdict"] == "stale"  # resolved path by path instead
    assert old is not model.weight


@pytest.mark.usefixtures("writer")
def test_a_diff_resolves_only_the_captured_owner_paths():
    """A registry that breaks after the capture, away from every captured owner's path:
    nothing moved, so the diff does not walk the model again (it resolves the paths it
    matched at capture time) and reports no error."""
    model = BreaksAfterCapture()
    with gt.trace(model) as t:
        with gt.capture("g"):
            model(torch.rand(4))
    model.broken = True
    model.__dict__["_modules"] = None
    del model.__dict__["_modules"]
    report = t.diff()
    assert report.meta["n_errors"] == 0
    e = report.edges.set_index("owners")
    assert e.loc["weight", "verdict"] == "stable"


def test_scalar_owners_of_some_values_are_those_of_all_values_filtered():
    """`scalar_owners(model, values)` (what each emulated capture's baked-scalar match asks)
    names exactly the floats of `scalar_owners(model)` whose value is in `values`."""
    from graphtrace.owners import resolve_value, scalar_owners

    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Dropout(0.25))
    model[0].scale = 0.5
    model[0].scaling = {"default": 0.5, "other": 2.0, 3: 0.25, ("a", 1): 0.5, "n": 7}
    model[1].big = {i: 0.5 for i in range(65)}  # too long to be a scalar holder
    model.empty = {}
    model.flag = True
    every = scalar_owners(model)
    assert ("0.scale", 0.5) in every and ("0.scaling['other']", 2.0) in every
    assert ("0.scaling[('a', 1)]", 0.5) in every and ("2.p", 0.25) in every
    assert not [p for p, _ in every if p.startswith("1.big")]
    for values in ({0.5}, {0.25, 2.0}, {1e-5}, set(), {0.5: "op", 1e-5: "op"}):
        assert scalar_owners(model, values) == [(p, v) for p, v in every if v in values]
        for path, value in scalar_owners(model, values):
            assert resolve_value(model, path) == value


class _Branches(nn.Module):
    """Each capture reads some of three plain-attribute tables, by the input's size."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.rand(4), torch.rand(4), torch.rand(4)

    def forward(self, x):
        if x.shape[0] == 1:
            return x * self.c
        if x.shape[0] == 2:
            return x * self.a + self.b
        return x * self.a


def test_a_reload_of_a_path_matched_captures_ago_is_seen_by_a_later_capture():
    """The cached owner walk is checked at each capture end against every path matched so
    far, whichever capture matched it and however many came at once (the check keeps the
    matched paths as they come: OwnerSnapshot._matched_paths): `a` and `b` are matched by
    the second capture, `a` is rebound after the third, and the fourth capture's read of the
    new `a` still finds its owner."""
    model = _Branches()
    with gt.trace(model) as t:
        graphs = []
        for label, rows in (("c", 1), ("ab", 2), ("c again", 1)):
            with gt.capture(label) as g:
                model(torch.ones(rows, 4))
            graphs.append(g)
        model.a = torch.rand(4)  # a reload that rebinds `a`
        with gt.capture("a") as g:
            model(torch.ones(3, 4))
        graphs.append(g)
        model.a = torch.rand(4)  # again: the walk at trace exit does not find the captured `a`
    edges = t.diff().edges
    assert sorted(edges[edges.owners == "a"]["graph"].astype(str)) == ["a", "ab"]
    assert sorted(edges[edges.owners == "b"]["graph"].astype(str)) == ["ab"]
    assert sorted(edges[edges.owners == "c"]["graph"].astype(str)) == ["c", "c again"]


@pytest.mark.parametrize("change", ["nothing", "an equal float, another object", "another float",
                                    "an equal int", "gone"])
def test_moved_compares_a_float_baseline_by_value(change):
    """PathSet.moved with a float in `expected` (a baked scalar's holder: the guard's blind
    spots) wants a float equal to it at the path, the same answer with and without native,
    and beside tensor paths in one set."""
    from graphtrace import native

    lib = native.load(required=False)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-5))
    paths = ["1.eps", "0.weight", "1.weight"]
    expected = [1e-5, *(resolve_path(model, p).untyped_storage()._cdata for p in paths[1:])]
    ln = model[1]
    if change == "an equal float, another object":
        ln.eps = float("1e-5")
    elif change == "another float":
        ln.eps = 1e-3
    elif change == "an equal int":  # equal as a number, but not the float the graph baked
        ln.eps = 1
        expected[0] = 1.0
    elif change == "gone":
        del ln.eps
    want = change not in ("nothing", "an equal float, another object")
    assert PathSet(paths).moved(model, expected) == want
    if lib is not None:
        assert PathSet(paths).moved(model, expected, lib) == want
