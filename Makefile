# Every target installs what it needs first; ARGS passes Hydra overrides, e.g.
#   make train ARGS="experiment=quick name=quick"
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# ARGS reach the app as typed, quotes and all (app/cli.py: typed_arguments): Hydra reads a value holding a comma, a
# bracket or <, > only in quotes (data.train='a.es,a.en'), which the shell strips from a command line.
app_args = NMT_ARGS="$(subst ",\",$(1))"
STAMP := $(VENV)/.installed
SWORD_PACKAGES := sword-text-sparv sword-text-web sword-text-kjv
# The CPU build is a few hundred MB; an unpinned torch on Linux is the multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch

# A setting given outside ARGS (make eval ARGS=name=quick decode.beam_size=1, unquoted) would be a make variable
# of its own, silently dropped: refuse any command-line variable whose name holds a dot.
DOTTED := $(strip $(foreach v,$(.VARIABLES),$(if $(findstring .,$(v)),$(if $(filter command line,$(origin $(v))),$(v)))))
ifneq ($(DOTTED),)
$(error $(firstword $(DOTTED))=$($(firstword $(DOTTED))) is a setting outside ARGS: quote them all, \
  make $(or $(MAKECMDGOALS),train) ARGS="$(strip $(ARGS) $(foreach v,$(DOTTED),$(v)=$($(v))))")
endif

.PHONY: setup data train eval translate score serve export align heads tensorboard lint test test-fast bench compare average clean gpu-wheels gpu-check
COMPARE_MODELS ?= rnn_plain,rnn_bahdanau,rnn_luong,transformer
COMPARE_EXPERIMENT ?= compare

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing CUDA torch"; $(PY) -m pip install -q "$(TORCH_GPU)"; \
	else \
		echo "no GPU: installing CPU torch ($(TORCH_CPU))"; $(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@dpkg -s $(SWORD_PACKAGES) >/dev/null 2>&1 || { \
		sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing Debian packages $(SWORD_PACKAGES)"; \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq $(SWORD_PACKAGES); }
	@touch $(STAMP)

data: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=prepare

# NPROC=N trains on N processes (GPUs) with torchrun and DDP; TORCHRUN_ARGS replaces --standalone for
# several machines, e.g. TORCHRUN_ARGS="--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=host0:29500 --rdzv_id=run1"
NPROC ?=
TORCHRUN_ARGS ?= --standalone
train: setup
ifeq ($(NPROC),)
	$(call app_args,$(ARGS)) $(PY) -m app command=train
else
	$(call app_args,$(ARGS)) $(VENV)/bin/torchrun $(TORCHRUN_ARGS) --nproc_per_node=$(NPROC) -m app command=train
endif

eval: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=eval

translate: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=translate

# How probable the run's model finds given translations (docs/configuration.md#scoring-translations-make-score):
# make score ARGS="name=quick score.source=a.es score.target=a.en", or a split's references (score.split=test)
score: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=score

# A local HTTP server for a trained run: a page that translates and draws the attention, and a JSON API
# (docs/serving.md): make serve ARGS="name=quick" (translate.engine=ct2: its export; serve.port=8000, serve.host)
serve: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=serve

# A run's Transformer as a CTranslate2 model in checkpoints/<run>/ct2 (export.quantization, default int8);
# then translate.engine=ct2 / eval.engine=ct2 decode with it.
export: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=export

# Word links of every pair of a corpus from a trained run (docs/attention.md#word-links-of-a-corpus-make-align):
# make align ARGS="name=<run> align.split=train" (or align.source=a.es align.target=a.en; align.reverse=<run>)
align: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=align

tensorboard: setup
	$(VENV)/bin/tensorboard --logdir checkpoints $(ARGS)

# ruff, then mypy over app/ (pyproject.toml's [tool.mypy]: the model API's Protocol, app/models/api.py, included)
lint: setup
	$(PY) -m ruff check app tests
	$(PY) -m ruff format --check app tests
	$(PY) -m mypy

# The explorer's browser tests drive Debian's headless Chromium; where it cannot be installed they skip.
TEST_PACKAGES := chromium
BROWSER_STAMP := $(VENV)/.browser
$(BROWSER_STAMP): | setup
	@dpkg -s $(TEST_PACKAGES) >/dev/null 2>&1 || { \
		sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing Debian packages $(TEST_PACKAGES) (for the browser tests)"; \
		$$sudo apt-get install -y -qq $(TEST_PACKAGES) >/dev/null 2>&1 || \
		{ $$sudo apt-get update -qq && $$sudo apt-get install -y -qq $(TEST_PACKAGES) >/dev/null; } || \
		echo "could not install $(TEST_PACKAGES): the browser tests will skip"; }
	@touch $(BROWSER_STAMP)

# The suite in two pytest-xdist workers of one thread each (a test file per worker at a time; on 2 cores both
# run at full speed), then the tests that hold runs to wall-clock budgets, alone: beside another worker their
# timings would measure the machine. Both parts run; the recipe fails with the first failing part's code.
# pytest exits 5 when it collected no test: a failure, unless ARGS narrowed the selection to one part's tests.
# Each worker runs the CLI as forks of a warm interpreter that imported torch & co. once (tests/warm_cli.py);
# NMT_TESTS_FRESH=1 gives every CLI run an interpreter of its own instead.
NARROWED := $(if $(strip $(ARGS)),1,0)
test: lint $(BROWSER_STAMP)
	@OMP_NUM_THREADS=1 $(PY) -m pytest tests -n 2 --dist loadfile -m "not wall_clock" $(ARGS); parallel=$$?; \
	$(PY) -m pytest tests -m wall_clock $(ARGS); alone=$$?; \
	if [ $(NARROWED) = 1 ] && [ $$parallel -eq 5 ] && [ $$alone -ne 5 ]; then parallel=0; fi; \
	if [ $(NARROWED) = 1 ] && [ $$alone -eq 5 ] && [ $$parallel -ne 5 ]; then alone=0; fi; \
	if [ $$parallel -ne 0 ]; then exit $$parallel; fi; exit $$alone

# The tests not marked slow (no CLI subprocesses, compiles, toy trainings or browsers): about a minute.
test-fast: lint $(BROWSER_STAMP)
	$(PY) -m pytest tests -m "not slow" $(ARGS)

# One Hydra multirun trains and evaluates every model of COMPARE_MODELS on the same data and budget, then
# one report over every run in the folder: COMPARE_DIR/compare.md and bleu_by_length.png. A run's folder is
# named by its settings, so the same command again continues a cut sweep (finished runs are kept, a cut one
# resumes from its last.pt), and later calls into the same COMPARE_DIR add runs, e.g. one model per call:
#   make compare COMPARE_DIR=checkpoints/compare_h100 COMPARE_MODELS=rnn_plain ARGS="train.max_minutes=4"
compare: setup
	@dir=$(or $(COMPARE_DIR),checkpoints/compare/$$(date +%Y-%m-%d_%H-%M-%S)); \
	$(call app_args,$(ARGS)) $(PY) -m app --multirun command=train model=$(COMPARE_MODELS) \
	  experiment=$(COMPARE_EXPERIMENT) hydra.sweep.dir=$$dir train.evaluate=true train.auto_resume=true && \
	$(call app_args,$(filter eval.% decode.% compare.%,$(ARGS))) $(PY) -m app command=compare compare.dir=$$dir

# How much each attention head of a run's Transformer matters, masked one by one (docs/attention.md#how-much-each-head-matters-make-heads):
# make heads ARGS="name=<run>" (heads.split=dev, heads.max_sentences=500) -> checkpoints/<run>/heads/<split>/
heads: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=heads

# Average the newest snapshots of a run: make average ARGS="name=<run> average.last=5" -> averaged.pt
average: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=average

bench: setup
	$(call app_args,$(ARGS)) $(PY) -m app command=bench

# A lent GPU machine (no internet, PyTorch but none of the packages below): `make gpu-wheels` here puts
# them in .whl/ as Python 3.12 wheels; carry .whl and data/ there and run `make gpu-check PART=paths` first
# (then transformer, rnn, bench, ablation, compare): scripts/gpu_check.sh says what each part measures.
# ctranslate2 (a 43 MB wheel: with data/ it passes the 64 MiB a call carries) only on request, for a call
# that times the CTranslate2 rows: make gpu-wheels GPU_WHEELS_EXTRA=ctranslate2==4.8.5
GPU_WHEELS ?= hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 $(GPU_WHEELS_EXTRA)
GPU_SDISTS ?= antlr4-python3-runtime==4.9.3 pysword==0.2.8
gpu-wheels:
	mkdir -p .whl
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	python3 -m pip wheel -q --no-deps -w .whl $(GPU_SDISTS)

# make gpu-check PART=paths|compile|tests|transformer|rnn|bench|ablation|decoding|compare|collect. paths, compile and tests run the
# gpu test tier (pytest -m gpu tests/test_gpu.py tests/test_decoding_gpu.py: pass/fail, junit XML and <part>.json
# in OUT, default checkpoints/gpu_check): paths in stages whose budgets (stated in the script) fit one 10-minute
# call, two compile tests last; compile the other compile tests; tests all in one pytest call (more than one
# call's time). The other parts are the timed figures; compare (PLAN=docs/compare_h100: the plan's next run
# without a record) there and collect (PLAN=... FROM=<the calls' files>: records in, report out) here carry
# a sweep across calls and sessions.
PART ?= transformer
gpu-check:
	bash scripts/gpu_check.sh $(PART)

clean:
	rm -rf checkpoints/*/ outputs multirun .pytest_cache
	find data -mindepth 1 -not -name README.md -delete
