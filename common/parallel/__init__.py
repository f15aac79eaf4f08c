"""Several processes as one job. A call that makes a collective, here or elsewhere, must be made
by every process, in the same order: the scripts mark those calls ``# ALL``. The agreement that
a failure on one process stops all of them is common/failures.py, which the folders share.

    launch          the processes the launcher started, one per GPU, the batch cut in equal
                    slices; several processes on one GPU (--share-gpus)
    step_guard      after each optimizer step, whether every process stops (a stop signal: SLURM,
                    Kubernetes, Ctrl-C; a non-finite loss; fp16's run of skipped steps), and why
    amp             mixed precision: the 16-bit format, fp16's skipped steps (train_amp.py)
    data_parallel   nn.DataParallel's GPUs: which ones, whether copies between them arrive
                    intact, their memory (train_dp.py)
    fsdp            FSDP2 through Accelerate for image classifiers (train_fsdp.py)
"""
