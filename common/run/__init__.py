"""What a run writes and reads back; what a later run reads is never half-written (common/files.py).

    lock         the run folder's lock: one job writes a run folder at a time
    folder       which run folder a run writes, and which checkpoint it continues from
    checkpoints  when the training state is saved, writing it whole, the newest good one
    record       config.json and metrics.jsonl, and the check that a resume is the same run
    weights      the final weights: model.safetensors, with what evaluation needs
"""
