"""What a run reports as it trains; a tracker or output that fails costs a warning, not the run.

    output       stdout and stderr that never raise (a closed pipe, a hung-up terminal)
    tracking     the one log line per epoch, and the trackers (--report-to: wandb, ...)
    profiling    --profile: a torch.profiler trace of chosen steps, and its table
    utilisation  each GPU's utilisation over an epoch (NVML), the time spent waiting for batches,
                 peak memory
"""
