"""Batches straight from uint8 tensors: one indexing operation per batch, no per-image Python."""

import torch
from torch.utils.data import DataLoader, Dataset


class TensorImages(Dataset):
    """Images and labels held as two tensors, on the CPU or already on the training device.

    ``__getitems__`` lets the DataLoader fetch a whole batch with one index instead of stacking
    one sample at a time (torch.utils.data's batched fetch), which is what makes a tensor-held
    dataset fast.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):
        index = torch.as_tensor(indices, device=self.labels.device)
        return self.images[index], self.labels[index]


def _batch_as_is(batch):
    return batch  # __getitems__ already returns the stacked batch


def tensor_loader(images, labels, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    """A DataLoader over tensors; training loaders drop the last partial batch.

    The loader gets its own generator: one without it draws its seed from the global RNG, which
    would make a resumed run shuffle differently from an uninterrupted one.
    """
    return DataLoader(TensorImages(images, labels), batch_size=batch_size, shuffle=shuffle,
                      drop_last=shuffle, collate_fn=_batch_as_is,
                      generator=torch.Generator().manual_seed(seed))
