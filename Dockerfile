# The image that accelerate_configs/kubernetes/ names: the project and requirements.txt on a CUDA
# torch. Build it from the project root, push it, and put its name in the manifests' image fields:
#   docker build -t registry.example.com/multigpu-cifar:0.1.0 .
#   docker push registry.example.com/multigpu-cifar:0.1.0
# Untested: the machines the tests run on cannot pull a base image, so this file has never been
# built (tests/test_kubernetes.py runs the manifests' command on a CPU instead).
FROM python:3.11-slim

# torch from PyPI is the CUDA build on Linux x86_64, the CUDA libraries in pip packages of their own
# (torch 2.15: CUDA 13, which needs NVIDIA driver 580 or newer on the nodes; the driver itself comes
# from the node, through the NVIDIA container toolkit). For older drivers take torch from PyTorch's
# index of an older CUDA: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_INDEX_URL=""

# Unbuffered: kubectl logs shows each line when it is printed, and nothing is lost at a SIGKILL.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The manifests' command (torchrun scripts/train_ddp.py) and run folders (runs/, the volume's mount
# point) are relative to this folder.
WORKDIR /workspace

# The requirements in a layer of their own, so that editing a script does not reinstall torch: the
# scripts' (requirements.txt) and the optional ones a cluster run wants (nvidia-ml-py for each GPU's
# utilisation; TensorBoard and MLflow for --report-to). Not the development tools.
COPY requirements.txt requirements-optional.txt ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install torch torchvision --index-url "$TORCH_INDEX_URL"; \
    fi \
    && pip install -r requirements.txt -r requirements-optional.txt

COPY . .
# common/ and bench/ importable from any folder, scripts/'s links aside (pyproject.toml; its
# dependencies are installed above)
RUN pip install --no-deps -e .
