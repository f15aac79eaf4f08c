"""One image: decoded to uint8 RGB from file bytes, a path or a tensor, and fitted to N x N.

torchvision.io.decode_image (libjpeg-turbo, libpng, libwebp) first; PIL only for what it cannot
read, e.g. CMYK or 16-bit files some versions refuse. Both input paths decode through here: the
device path every image once (common.data.decode), the workers path a sample at a time.

Every resize of either path is antialiased and bilinear, or bicubic where pretrained weights were
trained so (INTERPOLATIONS; common.data.pretrained picks it).
"""

import io
import os
from contextlib import suppress

import numpy as np
import PIL.Image
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from common.errors import first_line

# The interpolations the input paths resize with: bilinear, unless pretrained weights say bicubic
# (timm's ResNets). Antialiased, torchvision's bicubic is PIL's (Keys' a = -0.5), as timm trained.
INTERPOLATIONS = {name: v2.InterpolationMode[name.upper()] for name in ("bilinear", "bicubic")}


class BadImage(Exception):
    """An image no decoder can read. An Exception, not a UserError (SystemExit): a DataLoader worker
    passes Exceptions on to the main process, where the hook of
    common.data.workers.report_bad_images makes it one line."""


def decode(encoded, name: str) -> torch.Tensor:
    """An image as uint8 RGB (3, H, W), from file bytes, a file path or an already decoded tensor;
    grayscale, palette and CMYK images are converted to RGB, an alpha channel is dropped."""
    if isinstance(encoded, torch.Tensor):
        return encoded
    if isinstance(encoded, (str, os.PathLike)):
        try:
            with open(encoded, "rb") as f:
                encoded = f.read()
        except OSError as e:
            raise BadImage(f"cannot read image {name} ({first_line(e)})") from None
    with suppress(RuntimeError, ValueError):  # a format or mode torchvision does not read: PIL may
        image = decode_image(torch.frombuffer(bytearray(encoded), dtype=torch.uint8),
                             mode=ImageReadMode.RGB)
        if image.ndim == 4:  # an animated GIF comes as all its frames: the first, as PIL reads it
            image = image[0]
        return v2.functional.to_dtype(image, torch.uint8, scale=True)  # 16-bit PNGs; uint8 as is
    try:
        with PIL.Image.open(io.BytesIO(encoded)) as image:
            pixels = np.asarray(image.convert("RGB"))
    except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for corrupt or truncated files
        raise BadImage(f"cannot decode image {name} ({first_line(e)})") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous()


def fit(image: torch.Tensor, size: int, interpolation: str = "bilinear") -> torch.Tensor:
    """Resize the shorter side to ``size`` with ``interpolation`` (of INTERPOLATIONS) and crop the
    centre square: the evaluation view. An image already size x size is returned as it is."""
    if image.shape[-2:] == (size, size):
        return image
    image = v2.functional.resize(image, size, INTERPOLATIONS[interpolation], antialias=True)
    return v2.functional.center_crop(image, [size, size])
