"""S3 object storage for checkpoints: ``s3://bucket/prefix`` URLs over boto3 (docs/reports/s3-client-choice-*.md).

* ``url.py``: ``S3Url`` (parse and validate ``s3://bucket/prefix``), ``S3Options`` (endpoint, region,
  credentials, part size, concurrency, retries and deadlines; the usual AWS variables and config files fill what
  is not given).
* ``objects.py``: ``S3Objects``, the object layer: multipart uploads streamed from memoryviews with per-part
  SHA-256, conditional put, ranged parallel reads, listing, deletion, abort of every failed upload.
* ``retry.py``: which failures are retried, backoff, bounds in count and time.
* ``errors.py``: the named errors.
* ``storage.py``: ``S3Storage``, the ``Storage`` backend of ``s3://`` (``CheckpointOptions(storage=...)``); exported
  here, imported on first use.

boto3 is an optional dependency (``pip install ".[s3]"``); importing this package without it raises ImportError
naming the extra.
"""

from .errors import (
    S3AccessDeniedError,
    S3BucketNotFoundError,
    S3CommitConflictError,
    S3ConfigError,
    S3EndpointError,
    S3Error,
    S3StalledError,
    S3TransferError,
)
from .url import S3Options, S3Url

__all__ = [
    "S3AccessDeniedError",
    "S3BucketNotFoundError",
    "S3CommitConflictError",
    "S3ConfigError",
    "S3EndpointError",
    "S3Error",
    "S3Options",
    "S3StalledError",
    "S3Storage",
    "S3TransferError",
    "S3Url",
]


def __getattr__(name: str):
    if name == "S3Storage":  # the backend (storage.py, which registers itself) loads on first use, as s3:// does
        from .storage import S3Storage

        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
