"""Which S3 failures are retried, and the retry loop bounded in count and in time.

Why: a checkpoint upload must either finish or fail within a known time, naming the object and the last error
(marin #9209: multi-hour silent stalls). botocore's own retries are switched off (one place decides); each request
is tried at most ``max_attempts`` times, never started after ``retry_deadline_s``, and a try that moves no byte
for ``stall_timeout_s`` fails (socket timeout). Throttling (503 SlowDown, 429), 5xx, resets and timeouts are
retried with exponential backoff and full jitter; 4xx replies are not.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from botocore import exceptions as bce

from .errors import (
    S3AccessDeniedError,
    S3BucketNotFoundError,
    S3EndpointError,
    S3Error,
    S3ObjectNotFoundError,
    S3StalledError,
    S3TransferError,
)
from .url import S3Options

LOG = logging.getLogger(__name__)
T = TypeVar("T")

THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "RequestTimeout"}
    | {"ConditionalRequestConflict"}  # 409 while a concurrent conditional write is in flight: AWS says retry
)
DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "403"}
)
_TIMEOUTS = (bce.ReadTimeoutError, bce.ConnectTimeoutError, TimeoutError)
_UNREACHABLE = (bce.EndpointConnectionError, bce.ConnectTimeoutError)
_NETWORK = (
    bce.ConnectionClosedError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.HTTPClientError,  # base of the read errors above and of urllib3 protocol errors
    bce.ConnectionError,  # base of EndpointConnectionError, ConnectTimeoutError
    ConnectionError,
    TimeoutError,
)


class Cancelled(S3Error):
    """Another part of the same transfer failed for good: this one stops without further tries."""


def error_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError, ("", 0) otherwise."""
    if isinstance(exc, bce.ClientError):
        err, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
        return str(err.get("Code", "")), int(meta.get("HTTPStatusCode", 0) or 0)
    return "", 0


def retryable(exc: BaseException) -> bool:
    code, status = error_code(exc)
    if isinstance(exc, bce.ClientError):
        return status >= 500 or status == 429 or code in THROTTLE_CODES
    return isinstance(exc, _NETWORK)


def describe(exc: BaseException) -> str:
    code, status = error_code(exc)
    if code or status:
        msg = exc.response.get("Error", {}).get("Message", "")  # type: ignore[attr-defined]
        return f"HTTP {status} {code}: {msg}".strip()
    return f"{type(exc).__name__}: {exc}"


def fatal_error(exc: BaseException, what: str) -> S3Error:
    """The named error for a failure that is not retried (or whose retries are used up)."""
    code, status = error_code(exc)
    if isinstance(exc, bce.NoCredentialsError):
        return S3AccessDeniedError(f"{what}: no credentials found (S3Options, AWS_* variables or ~/.aws files)")
    if code in DENIED_CODES or status == 403:
        return S3AccessDeniedError(f"{what}: access denied ({describe(exc)}); check the credentials and rights")
    if code == "NoSuchBucket":
        return S3BucketNotFoundError(f"{what}: the bucket does not exist ({describe(exc)})")
    if code in ("NoSuchKey", "404") or status == 404:
        return S3ObjectNotFoundError(f"{what}: no such object ({describe(exc)})")
    if isinstance(exc, _UNREACHABLE):
        return S3EndpointError(f"{what}: the S3 endpoint cannot be reached ({describe(exc)})")
    return S3TransferError(f"{what}: {describe(exc)}")


def call(
    what: str, fn: Callable[[], T], opts: S3Options, cancel: threading.Event | None = None, start: float | None = None
) -> T:
    """Run ``fn`` (one S3 request) with the bounded retry policy; ``what`` names the object and the operation.

    ``start`` (monotonic) is when the operation began, for a deadline shared by several requests (a ranged read
    that resumes). Raises the named S3 error on a fatal reply, or S3TransferError / S3StalledError /
    S3EndpointError with the tries, elapsed time and last error once the bounds are reached."""
    start = time.monotonic() if start is None else start
    attempt = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"{what}: cancelled, another request of the transfer failed")
        attempt += 1
        try:
            return fn()
        except S3Error:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as a named error
            if not retryable(exc):
                raise fatal_error(exc, what) from exc
            elapsed = time.monotonic() - start
            delay = random.uniform(0, min(opts.backoff_max_s, opts.backoff_base_s * 2 ** (attempt - 1)))
            if attempt >= opts.max_attempts or elapsed + delay >= opts.retry_deadline_s:
                raise _exhausted(exc, what, attempt, elapsed, opts) from exc
            LOG.warning("%s: try %d failed (%s); retrying in %.2f s", what, attempt, describe(exc), delay)
            if cancel is not None and cancel.wait(delay):
                raise Cancelled(f"{what}: cancelled, another request of the transfer failed") from exc
            if cancel is None:
                time.sleep(delay)


def timed_out(exc: BaseException) -> bool:
    """A socket timeout anywhere in the exception's chain (botocore reports a send that timed out as a closed
    connection; the timeout is in its context)."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, _TIMEOUTS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _exhausted(exc: BaseException, what: str, attempt: int, elapsed: float, opts: S3Options) -> S3Error:
    bound = "tries" if attempt >= opts.max_attempts else f"retry deadline {opts.retry_deadline_s} s"
    detail = f"{what}: gave up after {attempt} tries in {elapsed:.1f} s ({bound} reached); last error: {describe(exc)}"
    if isinstance(exc, _UNREACHABLE):
        return S3EndpointError(detail + "; is the endpoint right and the server up?")
    if timed_out(exc):
        return S3StalledError(detail + " (a request moved no byte within its timeout: a stalled transfer)")
    return S3TransferError(detail)
