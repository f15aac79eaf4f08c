"""What the training scripts share, in floors: a module imports from its own floor and those below.

The floors, top first (tests/test_copy_set.py holds every import of common/ to this order); each
training script imports from every folder.

    cli         the flags every training script shares, checked before anything starts: it
                gathers each folder's flags, so it stands on all of them
    observe/    what a run reports: the log line and the trackers, the profiler, GPU
                utilisation, output that never raises
    parallel/   several processes as one job: the launch, stopping together after a step;
                the strategies' own: DataParallel's GPUs, AMP's 16-bit steps, FSDP2
    data/       the input path: a dataset by name or folder, decoded, cached and loaded; the
                weights to fine-tune from and the inputs they expect; the data flags
    run/        what a run writes and reads back: its folder and lock, checkpoints, the run
                record, the final weights
    recipe/     what is trained and how: the model, the optimizer and schedule, the numerics,
                compilation, weight averaging, evaluation
    failures    the ground floor, what the folders share: a failure on one process stops all of
                them (agreed, said once, no hang)
    faults      the faults a process meets by no fault of its code (a process, the store or a
                DataLoader worker lost, a collective timed out, no memory), each one line
    data_only   files from outside read as data only: no checkpoint or dataset runs code
    files       atomic files and folders; the paths flags name, checked before anything is written
    units       GB, as the reports give memory
    errors      UserError: bad input said in one line, with what to do, and no traceback
"""
