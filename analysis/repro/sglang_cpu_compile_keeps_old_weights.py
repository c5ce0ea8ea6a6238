"""SGLang CPU engine with --enable-torch-compile keeps serving the OLD weights after a weight update.

Standalone reproduction for the SGLang maintainers (SGLang, torch and transformers only; no
downloads, no GPU; about 2.5 minutes on 2 CPU cores).

What it does
  1. writes two tiny random float32 Llama checkpoints with transformers' `save_pretrained`,
     A and B (B = A plus noise of each tensor's own scale);
  2. starts `sglang.Engine(device="cpu", enable_torch_compile=True, cuda_graph_bs_decode=[1, 2])`
     on A: on CPU this builds SGLang's `CPUGraphRunner`, which compiles `model.forward` with
     `torch.compile` per decode batch size after setting `torch._inductor.config.freezing = True`;
  3. updates the weights to B the way RL frameworks do: `begin_weight_update()` ->
     `update_weights_from_tensor(B)` -> `end_weight_update()` (`--update disk`:
     `update_weights_from_disk(B)`); SGLang answers success;
  4. reads a weight back (`get_weights_by_name`): it holds B's values;
  5. greedy-generates 8 tokens for two prompts and compares with transformers on B and with a
     fresh compiled SGLang engine started on B (`--skip-fresh` skips the latter).
Expected: the updated engine's tokens equal both references.
Got (the bug): the first token is right, every later token is wrong.

Root cause (sglang 0.5.23)
  * `sglang/srt/model_executor/cpu_graph_runner.py`, `set_torch_compile_config()` sets
    `torch._inductor.config.freezing = True`; `patch_model()` then compiles
    `torch.no_grad()(model.forward)` and `CPUGraphRunner.capture_one_batch_size()` runs it once
    per batch size in `capture_bs`, which is when Inductor compiles. With freezing, Inductor
    treats the parameters as constants: on CPU it prepacks every linear's weight (the MLP,
    attention projections and `lm_head`) into new compiled-in buffers (Inductor's CPU
    `weight_prepack`, on by default), so the compiled decode graphs no longer read the
    parameters' storages.
  * A weight update writes the parameters in place (`param.data.copy_` in the loaders), which
    never reaches those packed copies. `WeightUpdater.update_weights_from_disk()`
    (`sglang/srt/model_executor/model_runner_components/weight_updater.py`) re-captures graphs
    only when `recapture_cuda_graph=True` and the device is cuda, musa or an out-of-tree
    platform with graph capture, never on CPU; `update_weights_from_tensor()` and
    `end_weight_update()` never re-capture, and `_unsupported_derived_weight_cache_error()`
    does not know of this cache.
  * Prefill (extend) runs the model eagerly on CPU (`CPUGraphRunner` captures decode only), so
    the first token comes from the new weights and every decoded token from the old ones.
Controls (each changes one thing):
  * `--no-freezing`: a plugin in SGLang's own plugin group (`sglang.srt.plugins`) sets
    `freezing = False` right after `set_torch_compile_config()`: NOT REPRODUCED;
  * `--no-weight-prepack`: freezing stays on, Inductor's CPU weight prepacking is off
    (`TORCHINDUCTOR_CPP_WEIGHT_PREPACK=0`): NOT REPRODUCED expected (the folded constants are
    then the parameters themselves).
Possible fixes: re-compile the CPU graphs after an update (reset Dynamo and build the
`CPUGraphRunner` again, as `recapture_decode_cuda_graph` does on CUDA), or compile without
freezing, or refuse updates while the frozen CPU graphs exist
(`_unsupported_derived_weight_cache_error`).

On this machine (see the printed CPU line): SGLang's CPU graph runner needs the intel_amx
attention backend, which SGLang refuses without AMX, and PyPI has no CPU build of sgl-kernel.
When the installed sgl_kernel has no CPU attention ops the script loads the stand-in
`sglang_cpu_standin/common_ops.py` (pure-torch versions of the two attention ops, next to
this file) in every SGLang process (on the path, and as an SGLang plugin), and sets SGLang's platform fact `has_amx=True`
(`sglang.srt.runtime_context.override_platform`) for argument resolution only. Neither
touches the linear layers or Inductor: float32 linears take SGLang's native path even on an
AMX Xeon (`amx_utils.dtype_is_supported`), so on an AMX Xeon with the CPU sgl-kernel build the
script runs unchanged and applies neither.

Exit status 0 whether or not the bug reproduces (see the final line); 2 if the script fails
or the engine disagrees with transformers before any update (nothing to conclude).
Run: SGLANG_USE_CPU_ENGINE=1 python sglang_cpu_compile_keeps_old_weights.py
         [--no-freezing | --no-weight-prepack] [--update tensor|disk] [--skip-fresh]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _repro import cpu_line, run

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROMPTS = [[1, 17, 45, 300, 12, 99, 7], [1, 400, 401, 402, 3, 5]]
NEW_TOKENS = 8
WEIGHT = "model.layers.0.mlp.down_proj.weight"   # read back after the update
STANDIN = Path(__file__).resolve().parent / "sglang_cpu_standin"

NO_FREEZING_PLUGIN = textwrap.dedent('''
    def register():
        """Turn Inductor freezing off right after SGLang's CPU graph runner turned it on."""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        def after(result, *args, **kwargs):
            import torch._inductor.config as inductor_config
            inductor_config.freezing = False
            return result

        HookRegistry.register(
            "sglang.srt.model_executor.cpu_graph_runner.set_torch_compile_config",
            after, HookType.AFTER)
''')


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    control = ap.add_mutually_exclusive_group()
    control.add_argument("--no-freezing", action="store_true",
                         help="control: Inductor freezing off (an SGLang plugin)")
    control.add_argument("--no-weight-prepack", action="store_true",
                         help="control: freezing on, Inductor's CPU weight prepacking off")
    ap.add_argument("--update", choices=("tensor", "disk"), default="tensor",
                    help="begin/update_weights_from_tensor/end (default) or update_weights_from_disk")
    ap.add_argument("--skip-fresh", action="store_true",
                    help="no fresh engine on B (transformers stays the reference)")
    return ap.parse_args()


def _prepend_path(folder: Path) -> None:
    """On sys.path here and on PYTHONPATH for SGLang's scheduler process."""
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder),
                                                             os.environ.get("PYTHONPATH")]))


def cpu_attention_ops() -> tuple[bool, str]:
    """Does the installed sgl_kernel load with its CPU attention ops? Asked in a subprocess: a
    failed `import sgl_kernel` must not be left half-done in this process."""
    code = "import torch, sgl_kernel; torch.ops.sgl_kernel.decode_attention_cpu"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    errors = [ln.strip("- ").strip() for ln in r.stderr.splitlines() if "Error:" in ln]
    return r.returncode == 0, "; ".join(errors[-2:]) or "ok"


def install_plugin(work: Path, module: str, source: str | None = None) -> None:
    """An SGLang plugin (entry point `<module>:register` in SGLang's plugin group
    `sglang.srt.plugins`, which SGLang loads in every process it starts), as an installed
    distribution in `work`; `source`: the module's text, when it is not on the path already."""
    plugin = work / f"plugin_{module}"
    dist = plugin / f"{module}-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[sglang.srt.plugins]\n{module} = {module}:register\n")
    if source is not None:
        (plugin / f"{module}.py").write_text(source)
    _prepend_path(plugin)


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """Two tiny random float32 Llama checkpoints, A and B = A + noise."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    a, b = root / "A", root / "B"
    model.save_pretrained(a, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * float(p.std()))
    model.save_pretrained(b, safe_serialization=True)
    return a, b


def hf_greedy(path: Path) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS on the checkpoint `path` (the reference)."""
    import torch
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = list(p)
            for _ in range(NEW_TOKENS):
                ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def start_engine(path: Path):
    import sglang

    t = time.time()
    engine = sglang.Engine(model_path=str(path), device="cpu", attention_backend="intel_amx",
                           enable_torch_compile=True, cuda_graph_bs_decode=[1, 2],
                           dtype="float32", max_total_tokens=1024, mem_fraction_static=0.05,
                           tp_size=1, random_seed=0, skip_tokenizer_init=True,
                           skip_server_warmup=True, log_level="error")
    print(f"  compiled engine on {path.name} up in {time.time() - t:.0f} s", flush=True)
    return engine


def generate(engine) -> list[list[int]]:
    res = engine.generate(input_ids=PROMPTS, sampling_params=dict(
        temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return [r["output_ids"] for r in res]


def update(engine, b: Path, how: str) -> list:
    """The update to B as an RL framework makes it; SGLang's answers."""
    if how == "disk":
        return [engine.update_weights_from_disk(str(b))]
    from safetensors.torch import load_file

    named = list(load_file(str(b / "model.safetensors")).items())
    return [engine.begin_weight_update(), engine.update_weights_from_tensor(named_tensors=named),
            engine.end_weight_update()]


def weight_holds(engine, b: Path) -> bool:
    """Does the engine's parameter WEIGHT hold B's values now (its first two rows)?"""
    import torch
    from safetensors.torch import load_file

    got = torch.tensor(engine.get_weights_by_name(WEIGHT, truncate_size=2), dtype=torch.float32)
    return torch.allclose(got, load_file(str(b / "model.safetensors"))[WEIGHT][:2])


def print_versions(notes: list[str]) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import sglang
    import torch
    import transformers

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    print(f"SGLang {sglang.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, sglang-kernel {ver('sglang-kernel')}, "
          f"Python {platform.python_version()}")
    print(f"CPU: {cpu_line()}, {os.cpu_count()} logical CPUs")
    for n in notes:
        print("note:", n)


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglang-cpu-compile-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")  # no cached graphs
    notes = []
    ok, why = cpu_attention_ops()
    if not ok:  # the stand-in, imported in every SGLang process by a plugin of its own
        _prepend_path(STANDIN)
        install_plugin(work, "common_ops")
        notes.append(f"the installed sgl_kernel has no CPU attention ops ({why[:160]}): "
                     f"using the pure-torch stand-in {STANDIN.name}/common_ops.py")
    if args.no_freezing:
        install_plugin(work, "repro_no_freezing", NO_FREEZING_PLUGIN)
        notes.append("CONTROL: Inductor freezing off (plugin after set_torch_compile_config)")
    if args.no_weight_prepack:
        os.environ["TORCHINDUCTOR_CPP_WEIGHT_PREPACK"] = "0"
        notes.append("CONTROL: Inductor CPU weight prepacking off (freezing stays on)")

    from sglang.srt.runtime_context import get_platform, override_platform

    if not get_platform().has_amx:
        override_platform(has_amx=True).install()
        notes.append("no AMX here: SGLang's platform fact has_amx set to True for argument "
                     "resolution, so that the intel_amx backend the CPU graph runner needs is kept")
    print_versions(notes)

    a, b = write_checkpoints(work)
    hf_a, hf_b = hf_greedy(a), hf_greedy(b)
    print(f"checkpoints: tiny random Llama (2 layers, hidden 128, vocab 512), float32, A and "
          f"B = A + noise ({work})")
    print("transformers greedy on A:", hf_a)
    print("transformers greedy on B:", hf_b)

    engine = start_engine(a)
    try:
        got_a = generate(engine)
        print("compiled engine on A:    ", got_a, "(= transformers on A)" if got_a == hf_a
              else "(!= transformers on A)")
        answers = update(engine, b, args.update)
        print(f"update to B ({args.update}):", answers)
        holds = weight_holds(engine, b)
        print(f"{WEIGHT} read back (get_weights_by_name) holds B's values: {holds}")
        got = generate(engine)
    finally:
        engine.shutdown()

    fresh = None
    if not args.skip_fresh:
        engine = start_engine(b)
        try:
            fresh = generate(engine)
        finally:
            engine.shutdown()

    print()
    print("expected (transformers on B):      ", hf_b)
    if fresh is not None:
        print("expected (fresh compiled engine, B):", fresh)
    print("got (engine on A, updated to B):   ", got)
    print("first token (eager prefill) right:", [g[0] for g in got] == [e[0] for e in hf_b],
          "| later tokens (compiled decode) right:", [g[1:] for g in got] == [e[1:] for e in hf_b])
    if got_a != hf_a or (fresh is not None and fresh != hf_b):
        print("INCONCLUSIVE: the compiled engine differs from transformers without any update")
        return 2
    if not all(ok for ok, _ in (x[:2] for x in answers)):
        print("INCONCLUSIVE: SGLang refused the update")
        return 2
    if got != hf_b:
        print("\nBUG REPRODUCED: after an update SGLang reported as successful (and whose "
              "parameters hold the new values) the compiled CPU engine serves tokens of the "
              "old weights")
    else:
        print("\nNOT REPRODUCED: the updated engine serves the new weights")
    return 0


if __name__ == "__main__":
    run(main)
