# The image that accelerate_configs/kubernetes/ names: the project and requirements.txt on a CUDA
# torch. Build it from the project root, push it, and put its name in the manifests' image fields:
#   docker build -t registry.example.com/multigpu-cifar:0.1.0 .
#   docker push registry.example.com/multigpu-cifar:0.1.0
# Never built here: these machines have no Docker engine and reach no registry. Checked by
# tests/test_kubernetes.py: the instructions parse, the base is pinned by digest, torch is pinned
# to a release that reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT, a C compiler for Triton is installed, the
# user is not root and is the one the runtime runs as, the caches are on the volume. docs/usage.md says what was not checked.
#
# The base by digest: the same bytes at every build (a tag moves). Taken from the python:3.11-slim
# of Docker Hub as public Dockerfiles pin it; not resolved here. To move to a newer one:
#   docker buildx imagetools inspect python:3.11-slim   # its "Digest:" line
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

# torch from PyPI is the CUDA build on Linux x86_64, the CUDA libraries in pip packages of their own
# (torch 2.14: CUDA 13, which needs NVIDIA driver 580 or newer on the nodes; the driver itself comes
# from the node, through the NVIDIA container toolkit). Pinned: torchrun reads
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (runtime.yaml) from pytorch PR #172596 (2026-03) on, and 2.14.1
# does (read in its torch/distributed/launcher/api.py); an older torch SIGKILLs the training
# processes 30 s after a SIGTERM whatever the variable says, and torchrun_pod.py warns of it.
# For older drivers, 2.14.1 from PyTorch's index of an older CUDA, one that has 2.14.1 (PyTorch's
# install page lists them; the build fails if it has not):
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG TORCH_INDEX_URL=""

# Unbuffered: kubectl logs shows each line when it is printed, and nothing is lost at a SIGKILL.
# XDG_CACHE_HOME on the volume (runs/, mounted by runtime.yaml): the dataset (Hugging Face's cache),
# its decoded tensors (multigpu-cifar) and torch hub weights are fetched once, not at every restart.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_CACHE_HOME=/workspace/runs/.cache

# The manifests' command (torchrun_pod.py, scripts/train_ddp.py) and run folders (runs/, the
# volume's mount point) are relative to this folder.
WORKDIR /workspace

# A C compiler and the C library's headers: Inductor's GPU kernels are Triton's, which builds its
# launcher with the C compiler it finds at run time (CC, else gcc), against Python's headers (the
# python image has them). Without one, --compile auto trains eagerly and says why; --compile
# inductor could not compile at all. The slim image has none.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The requirements in a layer of their own, so that editing a script does not reinstall torch: the
# scripts' (requirements.txt) and the optional ones a cluster run wants (nvidia-ml-py for each GPU's
# utilisation; TensorBoard and MLflow for --report-to). Not the development tools. torch first, at
# its pinned version, so that requirements.txt's lower bounds keep it.
COPY requirements.txt requirements-optional.txt ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"; \
    fi \
    && pip install -r requirements.txt -r requirements-optional.txt "torch==$TORCH_VERSION"

COPY . .
# common/ and bench/ importable from any folder, scripts/'s links aside (pyproject.toml; its
# dependencies are installed above)
RUN pip install --no-deps -e .

# Not root: namespaces that enforce the restricted Pod Security Standard refuse root containers.
# uid 1000 is the one runtime.yaml asks for (runAsUser), with a home of its own for the settings
# tools write there (wandb, matplotlib); it owns runs/ for a run without a volume.
RUN useradd --uid 1000 --user-group --create-home trainer \
    && mkdir -p runs && chown trainer:trainer runs
USER 1000:1000
