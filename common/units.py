"""The units the reports share: memory in GB of 10^9 bytes."""

GB = 1e9  # nvidia-smi shows MiB of 2^20 bytes; config.json, metrics.jsonl and the benchmark GB
