"""What a W&B dashboard receives, read from an offline run's transaction log (the `.wandb` file
that `wandb sync` uploads), with wandb's own protobuf Record classes.

The file: a 7-byte header (`:W&B`, magic 0xBEE1, version), then 32 KiB blocks of chunks, each
with a 7-byte header (CRC-32 of the type byte + payload, length, type FULL/FIRST/MIDDLE/LAST);
a record is one FULL chunk or FIRST + MIDDLE... + LAST. A block with fewer than 7 bytes left is
padded to its end."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[pb.Record]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1) and version in (0, 1), (ident, magic, version)
    out, pos, parts = [], HEADER, []
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"CRC at {pos}"
        pos += HEADER + length
        parts.append(payload)
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
            parts = []
        else:
            assert kind in (FIRST, MIDDLE), kind
    return out


@dataclass
class WandbRun:
    """The run as the dashboard sees it."""

    project: str = ""
    entity: str = ""
    group: str = ""
    name: str = ""
    run_id: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None


def _items(items) -> dict:
    out = {}
    for item in items:
        key = "/".join(item.nested_key) if item.nested_key else item.key
        out[key] = json.loads(item.value_json)
    return out


def read(path: Path) -> WandbRun:
    run = WandbRun()
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.project, run.entity, run.group = r.project, r.entity, r.run_group
            run.name, run.run_id, run.job_type = r.display_name, r.run_id, r.job_type
            run.tags = list(r.tags)
            run.config.update(_items(r.config.update))
        elif kind == "config":
            run.config.update(_items(rec.config.update))
        elif kind == "history":
            run.history.append(_items(rec.history.item))
        elif kind == "summary":
            run.summary.update(_items(rec.summary.update))
            for item in rec.summary.remove:
                run.summary.pop(item.key, None)
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    run.config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in run.config.items()}
    return run


def runs_under(path: Path) -> list[WandbRun]:
    """Every offline run under a run dir or a sweep dir (jobs and the report run)."""
    return [read(p) for p in sorted(Path(path).rglob("offline-run-*/run-*.wandb"))]
