"""What the training scripts share, one folder a concern; each training script imports from all.

    cli         the flags every training script shares, checked before anything starts
    errors      UserError: bad input said in one line, with what to do, and no traceback
    recipe/     what is trained and how: the model, its weights to start from, the optimizer
                and schedule, the numerics, compilation, weight averaging, evaluation
    data/       the input path: a dataset by name or folder, decoded, cached and loaded; the data
                flags
    parallel/   several processes as one job: the launch, failing and stopping together,
                DataParallel's GPUs, FSDP2
    run/        what a run writes and reads back: its folder and lock, checkpoints, the run
                record, the final weights, atomic files
    observe/    what a run reports: the log line and the trackers, the profiler, GPU
                utilisation, output that never raises
"""
