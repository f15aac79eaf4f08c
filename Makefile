# The two commands of the README: `make demo` trains, `make test` runs the suite. Both create the
# virtual environment in .venv and install requirements-dev.txt first (the scripts' packages, the
# optional ones, the tools of the tests and the benchmark, the project itself: docs/install.md),
# once, and again when a requirement file changes.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Extra flags for the script a target runs (demo, ddp, bench), after the target's own: the last
# value of a flag wins, e.g. make demo ARGS="--epochs 2 --model resnet32".
ARGS ?=

.PHONY: demo test test-floor test-cluster ddp bench gpu-check gpu-wheels diffs clean

$(BIN)/.installed: requirements.txt requirements-optional.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $@

# A CIFAR-sized ResNet-20 on the synthetic dataset: no download, about three minutes on 2 CPU cores.
demo: $(BIN)/.installed
	$(BIN)/python scripts/train_single.py --dataset synthetic --model resnet20 --epochs 8 $(ARGS)

# DDP that survives a crashed worker: torchrun restarts the job (up to 3 times) and every process
# resumes from the newest checkpoint by itself. The restart needs the c10d rendezvous, and the
# launcher must not share its TCP store with it, or the restarted job hangs. PET_STANDALONE=1 gives
# each job a rendezvous of its own (a free port, a random id): without it every job on the machine
# meets at localhost:29400, and a second `make ddp` there joins the first one's and fails.
# Defaults: ResNet-20 on the synthetic dataset; real data and models through ARGS:
# make ddp NPROC=4 ARGS="--dataset cifar10 --model resnet50" OUTPUT_DIR=runs/my-run
NPROC ?= 2
CONFIG ?= accelerate_configs/4gpu.yaml
OUTPUT_DIR ?= runs/train_ddp-$(shell date +%Y%m%d-%H%M%S)
ddp: $(BIN)/.installed
	TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PET_STANDALONE=1 $(BIN)/accelerate launch --config_file $(CONFIG) \
		--num_processes $(NPROC) --max_restarts 3 --rdzv_backend c10d \
		scripts/train_ddp.py --output-dir $(OUTPUT_DIR) --dataset synthetic --model resnet20 \
		--checkpoint-every 50 $(ARGS)

# The strategies this machine can run and the speed targets, measured side by side (docs/benchmarks.md).
bench: $(BIN)/.installed
	$(BIN)/python scripts/benchmark.py --output-dir runs/benchmark-$(shell date +%Y%m%d-%H%M%S) $(ARGS)

# Prove a GPU machine and the scripts on it in 9 minutes, in order of value (ARGS=--dry-run: the
# plan); the report goes to a new runs/gpu-check-<time> (docs/gpu/README.md). Not echoed:
# without a GPU its whole answer is one line (and make's own "Error 1").
gpu-check: $(BIN)/.installed
	@$(BIN)/python scripts/gpu_check.py $(ARGS)

# The wheels a GPU machine without network lacks (docs/gpu/README.md: the lent machines' image, its
# Python 3.12 on x86-64), downloaded here into .whl/ to be carried there and installed with
# pip install --no-index --no-deps. MLflow too: WHEELS="docs/gpu/wheels.txt docs/gpu/wheels-mlflow.txt".
WHEELS ?= docs/gpu/wheels.txt
gpu-wheels: $(BIN)/.installed
	mkdir -p .whl
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(foreach f,$(WHEELS),-r $(f))

# The suite starts hundreds of Python processes: the project's modules compiled once beforehand
# (where PYTHONDONTWRITEBYTECODE is set, Python would compile them again in every process). Three
# pytest-xdist workers, a file each at a time, the tests that launch at a launcher's default port
# one at a time (tests/conftest.py): on 2 cores the third fills the time the others spend waiting
# (a tracker's bound, a timeout, a job starting), 945 s against 1,039 s with two when measured. The
# whole suite on 2 cores since: 632 s when nothing else runs, 887 s beside other work (the README
# gives both in minutes; tests/test_docs.py holds them to these figures).
# tests/test_nodes.py makes network namespaces with iproute2's ip: installed where root can (Debian),
# else those tests skip and say why.
test: $(BIN)/.installed
	@command -v ip > /dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get > /dev/null \
		|| (apt-get update -qq && apt-get install -y -qq iproute2 > /dev/null) || true
	$(BIN)/python -m compileall -q common bench scripts > /dev/null
	$(BIN)/python -m pytest -q -m "not cluster" -n 3

# The tests marked cluster, which make test leaves out: slurm_2nodes.sh under a real SLURM on a
# cluster of two nodes made on this machine (accelerate_configs/slurm_cluster.py; 2.5 to 3.5
# minutes on 2 cores), and the faults between nodes. They need root and network namespaces;
# Debian's SLURM, munge and iproute2 are installed where root can, else they skip and say why.
test-cluster: $(BIN)/.installed
	@dpkg -s slurmd slurmctld slurm-client munge iproute2 > /dev/null 2>&1 || [ "$$(id -u)" != 0 ] \
		|| ! command -v apt-get > /dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq slurmd slurmctld slurm-client munge iproute2 > /dev/null) || true
	$(BIN)/python -m pytest -q -m cluster -p no:cacheprovider $(shell grep -l "mark.cluster" tests/test_*.py)

# The floors of requirements.txt and requirements-optional.txt, each a version a test ran
# (docs/install.md): uv installs the lowest versions the files allow (pip has no such mode) into
# .venv-floor, and the smoke set of the suite
# (the tests marked floor: train_single, a resume, evaluate.py, 2-process DDP, a fine-tune, the three
# trackers) runs there, from the repository's root. .ci/run runs it after the suite.
FLOOR := .venv-floor
$(FLOOR)/.installed: requirements.txt requirements-optional.txt $(BIN)/.installed
	rm -rf $(FLOOR)  # anew: uv keeps what an older environment satisfies, above the floors
	$(BIN)/uv venv --quiet --python $(PYTHON) $(FLOOR)
	$(BIN)/uv pip install --quiet --python $(FLOOR)/bin/python --resolution lowest-direct \
		-r requirements.txt -r requirements-optional.txt "pytest>=8.0"
	touch $@

# Only the files that hold such tests: the others import the development tools (kubeflow's models).
test-floor: $(FLOOR)/.installed
	PYTHONPATH=. $(FLOOR)/bin/python -m pytest -q -m floor -p no:cacheprovider \
		$(shell grep -l "mark.floor" tests/test_*.py)

# The lessons as diffs: each strategy script against the script it builds on (docs/diffs/).
diffs: $(BIN)/.installed
	$(BIN)/python docs/make_diffs.py

clean:
	rm -rf runs .pytest_cache
