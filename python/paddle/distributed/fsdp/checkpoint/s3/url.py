"""``s3://bucket/prefix`` URLs and the options of the S3 object layer.

Why here: every entry point that takes a checkpoint path takes such a URL; parsing and validation happen once,
before any request, so a typo is a named error (S3ConfigError) instead of a request to a wrong place. Endpoint,
region and credentials not given in ``S3Options`` come from boto3's usual chain at client creation:
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the ``~/.aws/config`` /
``~/.aws/credentials`` files (``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import S3ConfigError

SCHEME = "s3://"
MIN_PART, MAX_PART, MAX_PARTS = 5 << 20, 5 << 30, 10_000  # S3's multipart limits
MAX_KEY_BYTES = 1024
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


@dataclass(frozen=True)
class S3Url:
    """A bucket and a key prefix (no leading/trailing slash; "" for the bucket's root)."""

    bucket: str
    prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET.match(self.bucket) or ".." in self.bucket:
            raise S3ConfigError(
                f"invalid S3 bucket name {self.bucket!r}: 3-63 characters of a-z, 0-9, '.', '-', "
                "starting and ending with a letter or digit"
            )
        if _IPV4.match(self.bucket):
            raise S3ConfigError(f"invalid S3 bucket name {self.bucket!r}: an IP address")
        if not isinstance(self.prefix, str):
            raise S3ConfigError(f"S3 prefix must be a str, got {type(self.prefix).__name__}")
        if self.prefix:
            parts = self.prefix.split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise S3ConfigError(f"invalid S3 prefix {self.prefix!r}: empty, '.' or '..' segment")
            if len(self.prefix.encode()) > MAX_KEY_BYTES - 64:
                raise S3ConfigError(f"S3 prefix {self.prefix[:60]!r}... is too long for object keys")

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """``s3://bucket`` or ``s3://bucket/a/b`` (one trailing slash allowed) -> S3Url."""
        if not isinstance(url, str):
            raise S3ConfigError(f"S3 URL must be a str, got {type(url).__name__}")
        if not url.startswith(SCHEME):
            raise S3ConfigError(f"not an S3 URL (expected {SCHEME}bucket/prefix): {url!r}")
        rest = url[len(SCHEME) :]
        if any(c in rest for c in "?#\\") or any(ord(c) < 32 for c in rest):
            raise S3ConfigError(f"S3 URL {url!r} holds a query, fragment, backslash or control character")
        bucket, _, prefix = rest.partition("/")
        return cls(bucket, prefix[:-1] if prefix.endswith("/") else prefix)

    def key(self, name: str) -> str:
        """The object key of ``name`` (a relative name like ``"metadata.json"``) under this prefix."""
        if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
            raise S3ConfigError(f"invalid object name {name!r} under {self}")
        key = f"{self.prefix}/{name}" if self.prefix else name
        if len(key.encode()) > MAX_KEY_BYTES:
            raise S3ConfigError(f"object key too long ({len(key.encode())} bytes > {MAX_KEY_BYTES}): {key[:60]!r}...")
        return key

    def child(self, name: str) -> S3Url:
        return S3Url(self.bucket, self.key(name))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


@dataclass(frozen=True)
class S3Options:
    """How the object layer talks to the store. None fields come from boto3's environment/config chain.

    Attributes:
        endpoint_url: ``http(s)://host:port`` of an S3-compatible store (None: AWS, or ``AWS_ENDPOINT_URL*``).
        region: signing region (None: ``AWS_REGION`` etc., else ``us-east-1``).
        access_key_id, secret_access_key, session_token, profile: explicit credentials or profile.
        part_size: bytes per multipart part (5 MiB .. 5 GiB); host memory of an upload is at most
            part_size x concurrency when the data is not contiguous, about nothing when it is.
        concurrency: parallel requests per transfer.
        part_checksum: the checksum every request body carries and the store verifies (BadDigest on a mismatch):
            ``"crc32"`` (default: what boto3's own transfers send; the store computes it at a fraction of
            SHA-256's cost, which on a CPU-bound store is throughput) or ``"sha256"``. End to end integrity is
            the checkpoint's own per-chunk checksums either way.
        max_attempts: tries per request (1: no retry), for throttling, 5xx, resets and stalls.
        retry_deadline_s: a request and its retries give up after this many seconds in all.
        stall_timeout_s: a reply that moves no byte for this long fails as stalled.
        connect_timeout_s: TCP connect timeout (a wrong endpoint fails this fast, times max_attempts); urllib3
            also applies it to sending a request, so an upload the server stops reading fails after it.
        backoff_base_s, backoff_max_s: exponential backoff with full jitter between tries.
        addressing_style: ``"path"`` (needed by most S3-compatible servers), ``"virtual"`` or ``"auto"``.
    """

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    profile: str | None = None
    part_size: int = 64 << 20
    concurrency: int = 8
    part_checksum: str = "crc32"
    max_attempts: int = 5
    retry_deadline_s: float = 300.0
    stall_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0
    addressing_style: str = "path"

    def __post_init__(self) -> None:
        for name in ("part_size", "concurrency", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise S3ConfigError(f"S3Options.{name} must be a positive int, got {value!r}")
        if not MIN_PART <= self.part_size <= MAX_PART:
            raise S3ConfigError(f"S3Options.part_size must be within [5 MiB, 5 GiB], got {self.part_size}")
        for name in ("retry_deadline_s", "stall_timeout_s", "connect_timeout_s", "backoff_base_s", "backoff_max_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise S3ConfigError(f"S3Options.{name} must be a positive number, got {value!r}")
        if self.endpoint_url is not None and not re.match(r"^https?://[^/\s]+/?$", str(self.endpoint_url)):
            raise S3ConfigError(f"S3Options.endpoint_url must be http(s)://host[:port], got {self.endpoint_url!r}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise S3ConfigError("S3Options: give both access_key_id and secret_access_key, or neither")
        if self.part_checksum not in ("crc32", "sha256"):
            raise S3ConfigError(f"S3Options.part_checksum must be crc32 or sha256, got {self.part_checksum!r}")
        if self.addressing_style not in ("path", "virtual", "auto"):
            raise S3ConfigError(f"S3Options.addressing_style must be path/virtual/auto, got {self.addressing_style!r}")

    def parts_for(self, size: int) -> int:
        """Number of parts of an object of ``size`` bytes; refuses objects beyond S3's 10,000 parts."""
        n = max(1, -(-size // self.part_size))
        if n > MAX_PARTS:
            raise S3ConfigError(
                f"object of {size} bytes needs {n} parts of {self.part_size}; S3 allows {MAX_PARTS}: raise part_size"
            )
        return n
