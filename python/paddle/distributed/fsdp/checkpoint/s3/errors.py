"""Named errors of the S3 object layer: every one says which endpoint/bucket/object and which request failed.

They derive from the engine's CheckpointError family (so ``except CheckpointError`` still catches them) and are
registered in ``errors.ERROR_CLASSES`` so that a rank re-raising another rank's failure uses the same class.
"""

from __future__ import annotations

from .. import errors as _engine_errors
from ..errors import CheckpointError, CorruptCheckpointError, NotACheckpointError, SaveFailedError


class S3Error(CheckpointError):
    """Base class of the S3 object layer's errors."""


class S3ConfigError(S3Error, ValueError):
    """A malformed ``s3://`` URL or an invalid option (bad bucket name, part size out of S3's limits, ...)."""


class S3EndpointError(S3Error):
    """The endpoint cannot be reached or does not speak S3 (wrong host/port, refused, not an S3 reply)."""


class S3BucketNotFoundError(S3Error, NotACheckpointError):
    """The bucket of an ``s3://bucket/prefix`` URL does not exist."""


class S3AccessDeniedError(S3Error):
    """The credentials are unknown, wrong, or lack the right for the request (403)."""


class S3ObjectNotFoundError(S3Error, NotACheckpointError):
    """An object that should exist is absent (404 NoSuchKey)."""


class S3ObjectTruncatedError(S3Error, CorruptCheckpointError):
    """An object is shorter than a read needs (a truncated or replaced object)."""


class S3TransferError(S3Error):
    """A request failed for good: a non-retryable reply, or retries used up (count or time)."""


class S3StalledError(S3TransferError):
    """A transfer made no progress within its deadline (a server that stops reading or answering)."""


class S3CommitConflictError(S3Error, SaveFailedError):
    """A conditional put (If-None-Match: *) lost: another writer created the object first."""


S3_ERROR_CLASSES = (
    S3Error,
    S3ConfigError,
    S3EndpointError,
    S3BucketNotFoundError,
    S3AccessDeniedError,
    S3ObjectNotFoundError,
    S3ObjectTruncatedError,
    S3TransferError,
    S3StalledError,
    S3CommitConflictError,
)
_engine_errors.ERROR_CLASSES.update({cls.__name__: cls for cls in S3_ERROR_CLASSES})
