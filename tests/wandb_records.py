"""Read an offline wandb run (the run-<id>.wandb file) back with wandb's own protobuf schema.

The file is W&B's datastore: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB-log
style blocks of 32 KiB holding records (crc32c, length, type FULL/FIRST/MIDDLE/LAST), each payload
a serialised ``wandb_internal_pb2.Record``.
"""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb datastore"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < 7:  # too small for a record header: zero padding
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        payload = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def offline_run(run_dir: Path) -> dict:
    """The config, the history rows (step -> {key: value}), the exit code of an offline run and whether it
    was marked preempting (a run stopped to be resumed)."""
    (datastore,) = Path(run_dir).glob("run-*.wandb")
    config, history, exit_code, run_id, preempting = {}, {}, None, None, False
    for record in records(datastore):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row.get("_step"), {}).update(row)
        elif kind == "exit":
            exit_code = record.exit.exit_code
        preempting = preempting or kind == "preempting"
    return {"id": run_id, "config": config, "history": history, "exit_code": exit_code, "preempting": preempting}
