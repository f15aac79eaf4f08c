"""What a run writes and reads back; what a later run reads is never half-written.

    files        atomic files and folders (the old one or the whole new one); the paths flags
                 name, checked before anything is written
    lock         the run folder's lock: one job writes a run folder at a time
    folder       which run folder a run writes, and which checkpoint it continues from
    checkpoints  when the training state is saved, writing it whole, the newest good one
    record       config.json and metrics.jsonl, and the check that a resume is the same run
    weights      the final weights: model.safetensors, with what evaluation needs
    data_only    files from outside read as data only: no checkpoint or dataset runs code
"""
