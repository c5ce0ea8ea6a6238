"""Issue 4's must-shows: graphtrace finds the seed's bug on its own and confirms the fix,
through the built-in reload and through vLLM's real layerwise reload."""

from __future__ import annotations

import functools
import re

import pandas as pd
import pytest

import graphtrace as gt
from graphtrace.demo import runner
from graphtrace.demo.kernels import VARIANTS

BATCH_SIZES = (1, 2, 4)
N_LAYERS = 4
ROWS = sum(BATCH_SIZES)


@functools.lru_cache(maxsize=None)
def scenario(variant: str, backend: str, kind: str = "new-weights") -> runner.ScenarioResult:
    res = runner.run_scenario(variant, kind, device="cpu", batch_sizes=BATCH_SIZES, seed=0,
                              backend=backend, n_layers=N_LAYERS, out=None, strict=True)
    assert res.backend == backend
    assert res.n_errors == 0
    return res


def perm_edges(report) -> pd.DataFrame:
    return runner._perm_edges(report.edges)


def layer_of(owners: str) -> set[int]:
    return {int(m) for m in re.findall(r"layers\.(\d+)\.", owners)}


def owner_rows(report, pattern: str) -> pd.DataFrame:
    o = report.owners
    return o[o["path"].astype(str).str.contains(pattern, regex=False)]


# ---------------------------------------------------------------------------- unfixed

@pytest.mark.parametrize("variant,suffix", [("unfixed-partial", "act_perm.keywords['perm']"),
                                            ("unfixed-lambda", "act_perm.__closure__")])
def test_unfixed_every_layer_has_a_stale_perm_read(variant, suffix, reload_backend):
    res = scenario(variant, reload_backend)
    report = res.report
    perm = perm_edges(report)
    # one perm read per (graph, layer), every one of them stale (old storage kept alive)
    assert len(perm) == len(BATCH_SIZES) * N_LAYERS
    assert set(perm["verdict"].astype(str)) == {"stale"}
    assert set(perm["impact"].astype(str)) == {"manifest"}
    for graph in (f"bs{b}" for b in BATCH_SIZES):
        in_graph = perm[perm["graph"].astype(str) == graph]
        assert set().union(*map(layer_of, in_graph["owners"].astype(str))) == set(range(N_LAYERS))
    # the owner path ends in the partial's keyword / the lambda's closure cell
    for owners in perm["owners"].astype(str):
        (path,) = owners.split("; ")
        assert re.fullmatch(r"layers\.\d+\.mlp\.down_proj\.quant_method\.kernel\..+", path)
        assert suffix in path, path
        if variant == "unfixed-partial":
            assert path.endswith("act_perm.keywords['perm']")
    # the only stale edges are the perm reads; the weights the reload copies into are stable
    assert len(report.stale) == len(perm)
    weights = report.edges[report.edges["owners"].astype(str).str.contains("qweight")]
    assert len(weights) and set(weights["verdict"].astype(str)) == {"stable"}
    # the flip test changes no output; the graphs disagree with the live model
    assert res.flip_changed == 0
    assert res.replay_eq_eager == 0
    assert res.census["act_perm"] == (N_LAYERS, N_LAYERS, 0)  # all moved, none freed


# ---------------------------------------------------------------------------- rejected fix

def test_rejected_fix_perm_edge_is_diverged(reload_backend):
    res = scenario("rejected-fix", reload_backend)
    report = res.report
    perm = perm_edges(report)
    assert len(perm) == len(BATCH_SIZES) * N_LAYERS
    assert set(perm["verdict"].astype(str)) == {"diverged"}
    assert len(report.stale) == len(perm)
    # registered owner still holds the captured storage, the act_perm holder moved
    registered = owner_rows(report, "g_idx_sort_indices")
    bound = owner_rows(report, "act_perm.keywords['perm']")
    assert len(registered) == len(bound) == N_LAYERS
    assert set(registered["kind"].astype(str)) == {"parameter"}
    assert set(registered["status"].astype(str)) == {"holds"}
    assert set(bound["status"].astype(str)) == {"moved"}
    assert set(registered["storage_id"]) == set(bound["storage_id"])
    # values were copied back, so the diverged reads are latent; flipping act_perm's
    # (detached) perm changes nothing, as the seed's probe saw
    assert set(perm["impact"].astype(str)) == {"latent"}
    assert res.flip_changed == 0
    assert res.census["registered"] == (N_LAYERS, 0, 0)
    assert res.census["act_perm"] == (N_LAYERS, N_LAYERS, 0)


# ---------------------------------------------------------------------------- fix

def test_fix_has_no_stale_edges_and_flip_changes_every_output(reload_backend):
    res = scenario("fixed", reload_backend)
    report = res.report
    assert len(report.stale) == 0
    perm = perm_edges(report)
    assert len(perm) == len(BATCH_SIZES) * N_LAYERS
    assert set(perm["verdict"].astype(str)) == {"stable"}
    assert all(o.endswith("g_idx_sort_indices") for o in perm["owners"].astype(str))
    assert res.flip_changed == ROWS
    assert res.replay_eq_eager == ROWS
    assert res.census["registered"] == (N_LAYERS, 0, 0)


# ---------------------------------------------------------------------------- Marlin

def test_marlin_workspace_and_sort_indices_flagged(reload_backend):
    res = scenario("marlin", reload_backend)
    stale = res.report.stale
    owners = stale["owners"].astype(str)
    args = stale["args"].astype(str)
    for pattern, arg in (("quant_method.kernel.workspace", "workspace"),
                         ("mlp.down_proj.g_idx_sort_indices", "perm_or_none")):
        hit = stale[owners.str.endswith(pattern) & (args == arg)]
        assert len(hit) == len(BATCH_SIZES) * N_LAYERS, pattern
        assert set(hit["verdict"].astype(str)) == {"stale"}
        assert set().union(*map(layer_of, hit["owners"].astype(str))) == set(range(N_LAYERS))
    # the sort indices changed (manifest), the zeroed workspace did not (latent)
    impact = dict(zip(owners.str.endswith("workspace"), stale["impact"].astype(str)))
    assert impact == {True: "latent", False: "manifest"}
    assert len(stale) == 2 * len(BATCH_SIZES) * N_LAYERS
    # the sorted g_idx is a registered parameter: stable
    g = res.report.edges[res.report.edges["owners"].astype(str).str.endswith(".g_idx")]
    assert len(g) and set(g["verdict"].astype(str)) == {"stable"}
    assert res.flip_changed == 0


# ---------------------------------------------------------------------------- same weights

@pytest.mark.parametrize("variant", VARIANTS)
def test_same_weights_reload_is_silent_but_flagged(variant):
    res = scenario(variant, "builtin", "same-weights")
    new = scenario(variant, "builtin")
    assert res.replay_eq_before == ROWS  # bit-identical replay: nothing else notices
    assert res.act_order_changed == 0
    stale = res.report.stale
    assert len(stale) == len(new.report.stale)
    if variant == "fixed":
        assert len(stale) == 0
    else:
        assert len(stale) > 0
        assert set(stale["impact"].astype(str)) == {"latent"}


# ---------------------------------------------------------------------------- backends agree

def edge_key(report) -> list[tuple]:
    e = report.edges
    return sorted(zip(e["graph"].astype(str), e["ops"].astype(str), e["args"].astype(str),
                      e["owners"].astype(str), e["verdict"].astype(str),
                      e["impact"].astype(str)))


@pytest.mark.vllm
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.usefixtures("vllm_installed")
def test_vllm_and_builtin_reload_give_identical_verdicts(variant):
    for kind in ("new-weights", "same-weights"):
        a = scenario(variant, "builtin", kind)
        b = scenario(variant, "vllm", kind)
        assert edge_key(a.report) == edge_key(b.report)
        assert (a.flip_changed, a.replay_eq_eager, a.replay_eq_before, a.census) == \
               (b.flip_changed, b.replay_eq_eager, b.replay_eq_before, b.census)


@pytest.mark.parametrize("variant", VARIANTS)
def test_runner_check_accepts_every_variant(variant):
    ok, message = runner.check(scenario(variant, "builtin"),
                               scenario(variant, "builtin", "same-weights"))
    assert ok, message


# ---------------------------------------------------------------------------- command line

def test_demo_command_writes_reports(tmp_path, capsys):
    out = tmp_path / "rep"
    code = runner.main(["--variant", "unfixed-partial", "--variant", "fixed", "--out", str(out),
                        "--batch-sizes", "1,2", "--backend", "builtin", "--device", "cpu"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "── unfixed-partial" in text and "── fixed" in text
    assert "flip test" in text and "reports written under" in text
    assert "[1/2] unfixed-partial" in text  # progress
    for variant in ("unfixed-partial", "fixed"):
        for kind in ("new-weights", "same-weights"):
            rep = gt.load_report(out / variant / kind)
            assert len(rep.edges)
    assert len(gt.load_report(out / "unfixed-partial" / "new-weights").stale) == 4 * 2
    assert len(gt.load_report(out / "fixed" / "new-weights").stale) == 0
    summary = pd.read_csv(out / "demo_summary.csv")
    assert set(summary["variant"]) == {"unfixed-partial", "fixed"}
    assert summary["as_expected"].all()


def test_demo_command_quiet(tmp_path, capsys):
    code = runner.main(["--variant", "marlin", "--out", str(tmp_path), "--quiet",
                        "--batch-sizes", "2", "--backend", "builtin"])
    text = capsys.readouterr().out
    assert code == 0
    assert "[1/1]" not in text and "── marlin" not in text
    assert "marlin" in text and "ok: STALE READ" in text


def test_demo_help_and_bad_options(capsys):
    with pytest.raises(SystemExit) as exc:
        runner.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--variant", "--device", "--out", "--batch-sizes", "--seed", "--quiet",
                   "--backend"):
        assert option in text
    assert "flip test" in text and "unfixed-lambda" in text
    with pytest.raises(SystemExit) as exc:
        runner.main(["--variant", "nope"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        runner.main(["--batch-sizes", "0"])


def test_graphtrace_cli_runs_the_demo(tmp_path, capsys):
    from graphtrace.cli import main

    code = main(["demo", "--variant", "fixed", "--out", str(tmp_path), "--quiet",
                 "--batch-sizes", "1", "--backend", "builtin"])
    assert code == 0
    assert "ok: CLEAN" in capsys.readouterr().out
