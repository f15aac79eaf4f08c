"""What a run reports as it trains; none of it can stop training.

    output       stdout and stderr that never raise (a closed pipe, a hung-up terminal)
    tracking     the one log line per epoch, and the trackers (--report-to: wandb, ...)
    profiling    --profile: a torch.profiler trace of chosen steps, and its table
    utilisation  each GPU's utilisation over an epoch (NVML), and peak memory
"""
