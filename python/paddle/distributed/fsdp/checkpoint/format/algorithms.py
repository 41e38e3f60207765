"""The names of the checksum algorithms a checkpoint's metadata can record.

Why here: the names are part of the on-disk format (the ``checksum`` field of metadata.json); the code that
computes them (checkpoint/checksums.py) sits above format/ and imports these names from it.
"""

from __future__ import annotations

XXH3_64 = "xxh3-64"
CRC32 = "crc32"
NONE = "none"
KNOWN = (XXH3_64, CRC32, NONE)
