"""The COMMIT record: its bytes. A checkpoint directory is committed when its ``COMMIT`` record exists and names the
checkpoint id and the SHA-256 of ``metadata.json``: ``{"format", "checkpoint_id", "metadata_sha256"}``, and, for a
save that knows its run, ``"lineage": {"run", "parent", "time"}`` (which run committed it, the checkpoint id that
run continued from, the coordinator's clock at the commit; see lineage.py: what rotation and resume compare).

Pure (no I/O): writers (save/commit.py: the collective save and the tools' one-process writer) write the data
files, then ``metadata.json``, then ``COMMIT`` (last); readers (directory.py ``read_metadata``) trust nothing
that is not committed (the record is parsed by schema.py ``parse_commit``).
"""

from __future__ import annotations

import hashlib
import json

from .metadata import FORMAT_NAME


def commit_record(checkpoint_id: str, metadata_bytes: bytes, lineage: dict | None = None) -> bytes:
    record = {
        "format": FORMAT_NAME,
        "checkpoint_id": checkpoint_id,
        "metadata_sha256": hashlib.sha256(metadata_bytes).hexdigest(),
    }
    if lineage is not None:
        record["lineage"] = lineage
    return json.dumps(record).encode()
