"""FSDP2 through Accelerate for image classifiers: what train_fsdp.py needs beyond train_ddp.py.

- ``check_sharding``: the run really shards. Without GPUs Accelerate drops the FSDP plugin without
  a word (accelerate/state.py sets DistributedType.FSDP only for GPU-family devices) and wraps the
  model in DDP; a script that says it shards must then refuse.
- ``wrap_each_block``: each of the model's residual blocks its own FSDP unit. Accelerate's
  default (NO_WRAP) makes the whole model one unit, gathered whole for every forward: no memory
  saved.
- ``average_buffers``: BatchNorm's running statistics averaged over the processes. FSDP2 shards
  parameters only; buffers stay per process and, unlike DDP, nothing syncs them.
- ``ShardedWeightAverage``: --ema-decay's average of each process's slices, gathered whole into
  the checkpoints.
- ``gathered_model``: the full weights in a plain model on the main process, for model.safetensors.
- ``refuse_gloo``: processes that share a GPU (--share-gpus) share it over NCCL only.
- ``code_in_shards``: what of a sharded checkpoint would run code on --resume. DCP reads its
  folders (pytorch_model_fsdp_0/, optimizer_0/) with ``pickle.load`` (.metadata) and
  weights_only=False (values not tensors): they are read here first, with only their types
  allowed (common.data_only).
"""

import io
from pathlib import Path
from typing import NoReturn

import torch
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from common.data_only import DataUnpickler, code_in_checkpoint, file_problem
from common.errors import UserError
from common.parallel.launch import nccl_name, nccl_shares_gpus
from common.recipe.ema import WeightAverage, mean_over_processes
from common.recipe.models import build_model

# The repeated blocks of the models --model takes: ours and torchvision's ResNets (BasicBlock,
# Bottleneck), and torchvision's other classifiers (MobileNets, ShuffleNet, EfficientNets,
# ConvNeXt, RegNet, ViT, Swin, MaxViT, DenseNet, MNASNet).
BLOCKS = ("BasicBlock", "Bottleneck", "InvertedResidual", "MBConv", "FusedMBConv", "CNBlock",
          "ResBottleneckBlock", "EncoderBlock", "SwinTransformerBlock", "SwinTransformerBlockV2",
          "MaxVitBlock", "_DenseLayer", "_InvertedResidual")
_DTYPES = {("torch", str(t).split(".")[1]) for t in vars(torch).values()
           if isinstance(t, torch.dtype)}
# What DCP's .metadata holds (torch 2.14: every type a sharded checkpoint of ours names)
DCP_METADATA = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), *_DTYPES}


def check_sharding(accelerator, sync_bn: bool) -> None:
    """Refuse a run that would not shard, or --sync-bn (a UserError; call it through
    common.failures.refused_together for one line on N processes)."""
    if sync_bn:
        raise UserError("--sync-bn is train_ddp.py's: under FSDP2 each process normalises its own "
                        "slice and the running statistics are averaged over the processes every "
                        "step; drop --sync-bn, or train with train_ddp.py --sync-bn")
    if accelerator.distributed_type != DistributedType.FSDP:
        raise UserError(
            f"train_fsdp.py shards over GPUs only, and Accelerate runs this launch as "
            f"{accelerator.distributed_type.value} on {accelerator.num_processes} x "
            f"{accelerator.device.type} (without GPUs it drops the FSDP plugin and would run DDP): "
            f"launch it on 2 or more GPUs (accelerate launch --config_file "
            f"accelerate_configs/4gpu_fsdp.yaml), or use train_ddp.py on this machine")


def refuse_gloo(nccl: tuple[int, ...] | None, gpus: int) -> NoReturn:
    """For common.parallel.launch.set_gpu_sharing: FSDP2's processes share a GPU over NCCL only
    (version ``nccl``; ``gpus`` on the node). Over gloo they crashed with SIGSEGV on an H200 (torch
    2.11, NCCL 2.28.9, docs/gpu/nvidia-h200.md), gloo gathering sharded CUDA tensors
    (pytorch#132471)."""
    instead = ("use --share-gpus nccl" if nccl_shares_gpus(nccl) else
               f"this torch's NCCL ({nccl_name(nccl)}) cannot share a GPU: use a torch whose NCCL "
               f"is 2.30 or newer, pass --num_processes {gpus} (per node) to accelerate launch, or "
               f"rehearse the launch with train_ddp.py --share-gpus")
    raise UserError(f"--share-gpus: FSDP2's processes share a GPU over NCCL only (over gloo its "
                    f"collectives on sharded CUDA tensors crash, pytorch#132471); {instead}")


def wrap_each_block(accelerator, model: torch.nn.Module, name: str) -> None:
    """Make each of the BLOCKS ``model`` (--model ``name``) is made of an FSDP unit of its own, when
    ``prepare`` shards it, under the plugin's auto_wrap_policy="transformer_based_wrap": the
    classes are named (Accelerate refuses a name the model lacks, so only those found are)."""
    found = sorted({type(m).__name__ for m in model.modules()} & set(BLOCKS))
    if not found:
        raise UserError(f"--model {name} has no block train_fsdp.py knows how to shard one by one "
                        f"({', '.join(BLOCKS)}); sharded as one unit it would save no memory: "
                        "add its repeated block's class name to BLOCKS in "
                        "common/parallel/fsdp.py")
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = found  # read by prepare()


def average_buffers(accelerator, model: torch.nn.Module) -> None:
    """Every floating-point buffer (BatchNorm's running mean and variance) set to its mean over the
    processes. The running statistics are linear in the batches' statistics, so averaging every
    step gives what one average at the end would (up to rounding), and every process evaluates and
    saves the same buffers (a sharded checkpoint stores the main process's only)."""
    mean_over_processes(accelerator, [b for b in model.buffers() if b.is_floating_point()])


class ShardedWeightAverage(WeightAverage):
    """common.recipe.ema.WeightAverage of a model FSDP2 shards. Each parameter is a DTensor of which
    a process holds one slice, and deepcopy or torch.optim.swa_utils.AveragedModel refuse the
    sharded module: the average is kept of the local slices, so it is sharded like the weights and
    costs 1/N of them. A checkpoint holds it whole: state_dict() gathers each averaged slice into
    the full tensor (save_as_data calls it on every process, and writes the main process's), and
    load_state_dict() cuts the full tensor back into this process's slice."""

    def __init__(self, accelerator, model: torch.nn.Module, decay: float | None):
        super().__init__(accelerator, model, decay)  # of the DTensors, whose layouts are kept
        self.layouts = [t if isinstance(t, DTensor) else None for t in self.live]

        def local(tensor):  # this process's slice of a DTensor: its own storage, no copy
            return tensor.to_local() if isinstance(tensor, DTensor) else tensor
        self.live = [local(t) for t in self.live]
        self.average = [local(t) for t in self.average]  # the base class's clones, sliced

    def state_dict(self) -> dict:
        """The whole average: each slice gathered (an all-gather, a collective)."""
        return {"updates": self.updates, "decay": self.decay, "average": {
            name: (average if layout is None else DTensor.from_local(
                average, layout.device_mesh, layout.placements, run_check=False,
                shape=layout.shape, stride=layout.stride()).full_tensor()).cpu()
            for name, average, layout in zip(self.names, self.average, self.layouts)}}

    def load_state_dict(self, state: dict) -> None:
        """The whole average cut back into this process's slice of each tensor."""
        super().load_state_dict({**state, "average": {
            name: state["average"][name] if layout is None else distribute_tensor(
                state["average"][name].to(layout.device), layout.device_mesh,
                layout.placements).to_local()
            for name, layout in zip(self.names, self.layouts)}})


def gathered_model(accelerator, model, name: str, num_classes: int) -> torch.nn.Module | None:
    """A plain ``build_model(name, num_classes)`` holding the full weights of the sharded ``model``
    on the main process (None on the others), for common.run.weights.save_final_weights. A
    collective: every process must call it (Accelerate's get_state_dict all-gathers every shard;
    only the main process receives them, on the CPU)."""
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    with torch.device("meta"):  # no memory, no initialisation: the gathered tensors are taken
        plain = build_model(name, num_classes)
    plain.load_state_dict(state, assign=True)
    return plain


def code_in_shards(checkpoint: Path, process_index: int) -> str | None:
    """common.data_only.code_in_checkpoint for a sharded checkpoint: also what in its DCP folders
    would run code as torch reads them ("optimizer_0/.metadata could run code: it names
    posix.system, which is not data"); None: nothing. For common.run.checkpoints.resume_from."""
    if problem := code_in_checkpoint(checkpoint, process_index):
        return problem
    # torch then reads the bytes checked here, whose pickles can build nothing but the types
    # allowed; where .metadata does not load, DCP reads the process's own __<rank>.metadata
    for metadata in sorted({*checkpoint.glob("*/.metadata"), *checkpoint.glob("*/__*.metadata")}):
        name = metadata.relative_to(checkpoint).as_posix()
        try:
            with open(metadata, "rb") as f:
                index = DataUnpickler(f, DCP_METADATA).load()
            for key, where in index.storage_data.items():
                if isinstance(index.state_dict_metadata[key.fqn], BytesStorageMetadata):
                    name = f"{metadata.parent.name}/{where.relative_path}"
                    with open(metadata.parent / where.relative_path, "rb") as f:
                        f.seek(where.offset)
                        torch.load(io.BytesIO(f.read(where.length)), weights_only=True)
        except Exception as error:  # noqa: BLE001 - a refusal, or a file that is no DCP's
            return file_problem(name, error)
    return None
