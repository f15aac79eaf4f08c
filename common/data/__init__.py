"""The training scripts' input path, one module per job; data and imports flow down this list.

    options     DataOptions: the values of the data flags, all that the input path is told;
                the cache folder (--cache-dir or its default), made when needed
    splits      the containers: undecoded splits (files, tensors), a source's two, decoded data
    images      one image decoded to uint8 RGB and fitted to N x N; the interpolations resizes take
    hub         `datasets`: a Hub download (its cache when offline), any DatasetDict as splits
    formats     a local copy (--data-dir): its format detected, then read (CIFAR's pickles too)
    synthetic   CIFAR-shaped data made on the spot (--dataset synthetic)
    sources     a dataset by name or folder, opened, checked and carved (--val-fraction):
                open_source
    decode      every image of a source decoded once, at one size
    cache       the decoded data cached on disk, one file per source, size and interpolation:
                load_image_data
    stats       per-channel normalisation statistics of the training images
    transform   the augmentation: the crop both loaders draw (its box, per-sample seeds); a uint8
                batch to normalised float on the device, with batched crop, flip, random erasing,
                MixUp and CutMix (the labels turned into class shares)
    device      the device loader: the decoded dataset held on the training device
    workers     the workers loader: DataLoader workers decode and augment a sample at a time
    choice      which loader (--loader auto): the decoded size against the memory budget
    pretrained  pretrained weights for fine-tuning: found offline, the inputs they expect (size,
                normalisation, interpolation), loaded with the head swapped, the backbone frozen
                (--freeze backbone)
    flags       the data and augmentation flags: added, checked, and DataOptions made of them
    inputs      a run's loaders in one call (load_data, load_inputs), from all of the above
"""
