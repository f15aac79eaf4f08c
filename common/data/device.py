"""The device loader (--loader device): the decoded dataset held on the training device.

The whole dataset is one uint8 tensor per split, so the loader fetches a batch with one indexing
operation and no copy per batch; common.data.transform then augments and normalises it there.
"""

import dataclasses

import torch
from torch.utils.data import DataLoader, Dataset

from common.errors import UserError

# The decoded dataset may take at most this share of the GPU memory free when training starts; the
# rest is for the model, its activations, gradients and optimizer state, and the allocator's cache.
DEVICE_DATA_SHARE = 0.5


def on_device(data, device: torch.device):
    """``data`` (common.data.splits.ImageData) with its tensors on ``device``, where the loader
    indexes them; the host copy, no longer referenced, is freed (a cache loaded with mmap=True only
    ever mapped it). A dataset that would take more than DEVICE_DATA_SHARE of the GPU's free memory
    is refused with its size, instead of a CUDA out-of-memory error now or at the first step."""
    tensors = ("train_images", "train_labels", "test_images", "test_labels")
    size = sum(getattr(data, name).nbytes for name in tensors)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
    if size > DEVICE_DATA_SHARE * free:
        raise UserError(
            f"the decoded dataset takes {size / 1e9:.1f} GB, and this template keeps it on every "
            f"GPU: more than {DEVICE_DATA_SHARE:.0%} of the {free / 1e9:.1f} GB free on {device}; "
            f"train on fewer or smaller images, or on GPUs with more free memory")
    return dataclasses.replace(data, **{name: getattr(data, name).to(device) for name in tensors})


class TensorImages(Dataset):
    """Images and labels held as two tensors, on the CPU or already on the training device:
    ``__getitems__`` lets the DataLoader fetch a whole batch with one index instead of stacking one
    sample at a time (torch.utils.data's batched fetch), which is what makes it fast."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):
        index = torch.as_tensor(indices)
        if self.labels.is_cuda:
            # From pinned memory the copy is queued behind the GPU's work; from pageable memory
            # the host would wait for all of it (the previous step's backward) every batch.
            index = index.pin_memory().to(self.labels.device, non_blocking=True)
        return self.images[index], self.labels[index]


def tensor_loader(images, labels, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    """A DataLoader over tensors; training loaders drop the last partial batch. It gets its own
    generator: one without draws its seed from the global RNG, which would make a resumed run
    shuffle differently from an uninterrupted one."""
    return DataLoader(TensorImages(images, labels), batch_size=batch_size, shuffle=shuffle,
                      drop_last=shuffle, collate_fn=lambda batch: batch,  # __getitems__ stacked it
                      generator=torch.Generator().manual_seed(seed))
