"""Read a wandb offline run's `.wandb` file back: wandb's own protobuf records (wandb.proto.wandb_internal_pb2)
from its LevelDB-style log (a 7-byte ":W&B" header, then 32 KiB blocks of crc/length/type-framed chunks).
wandb 0.31 ships no Python reader for it (the old wandb.sdk.internal.datastore went with the Go core), so the
framing is decoded here and the records by wandb's protobuf classes."""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, "not a wandb log"
    pos, records, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def history_and_config(path: Path) -> tuple[list[dict], dict, dict]:
    """(history rows, run config, summary) as plain values."""
    history, config, summary = [], {}, {}
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.history.item})
        elif kind == "config":
            for item in rec.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "run":
            for item in rec.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, config, summary
