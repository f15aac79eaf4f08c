# The two commands of the README: `make demo` trains, `make test` runs the suite. Both create the
# virtual environment in .venv and install requirements.txt first, once (again when it changes).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test diffs clean

$(BIN)/.installed: requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

# A CIFAR-sized ResNet-20 on the synthetic dataset: no download, about two minutes on 2 CPU cores.
demo: $(BIN)/.installed
	$(BIN)/python scripts/train_single.py --dataset synthetic --model resnet20 --epochs 8

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

# The lessons as diffs: each strategy script against the script it builds on (see README).
diffs: $(BIN)/.installed
	$(BIN)/python docs/make_diffs.py

clean:
	rm -rf runs .pytest_cache
