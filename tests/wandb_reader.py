"""Offline reader for a W&B transaction log (run-*.wandb): LevelDB-log framing + wandb Record protobufs.

wandb 0.31 no longer ships wandb.sdk.internal.datastore (its reader), so this re-implements its scan
loop; the tests read what tracker=wandb wrote with it, from the run files alone."""

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"  # ident, magic, version
BLOCK = 32768


def records(path):
    data = Path(path).read_bytes()
    assert data[:7] == HEADER, f"bad header {data[:7]!r}"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:                      # block trailer padding
            pos += left; continue
        crc, length, rtype = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and rtype == 0:    # zero padding at end of block / file
            pos += left; continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([rtype]))) & 0xFFFFFFFF == crc, f"crc mismatch at {pos}"
        pos += 7 + length
        if rtype == 1:                    # FULL
            buf = chunk
        elif rtype == 2:                  # FIRST
            buf = chunk; continue
        elif rtype == 3:                  # MIDDLE
            buf += chunk; continue
        elif rtype == 4:                  # LAST
            buf += chunk
        rec = pb.Record(); rec.ParseFromString(buf)
        yield rec


def summarize(path):
    """-> dict(config, summary, history[list of dict], files, run) decoded from the log."""
    out = {"config": {}, "summary": {}, "history": [], "files": [], "run": {}, "kinds": {}}
    def val(item):
        return json.loads(item.value_json)
    def key(item):  # items are flattened: nested_key ["plots/x", "sha256"] -> d["plots/x"]["sha256"]
        return tuple(item.nested_key) if item.nested_key else (item.key,)
    def put(d, k, v):
        for part in k[:-1]:
            d = d.setdefault(part, {})
        d[k[-1]] = v
    for r in records(path):
        kind = r.WhichOneof("record_type")
        out["kinds"][kind] = out["kinds"].get(kind, 0) + 1
        if kind == "run":
            out["run"] = {"id": r.run.run_id, "project": r.run.project, "group": r.run.run_group,
                          "job_type": r.run.job_type, "tags": list(r.run.tags), "name": r.run.display_name}
            for u in r.run.config.update:
                put(out["config"], key(u), val(u))
        elif kind == "config":
            for u in r.config.update:
                put(out["config"], key(u), val(u))
        elif kind == "history":
            row = {}
            for i in r.history.item:
                put(row, key(i), val(i))
            out["history"].append(row)
        elif kind == "summary":
            for u in r.summary.update:
                put(out["summary"], key(u), val(u))
        elif kind == "files":
            out["files"] += [f.path for f in r.files.files]
    return out
