"""The boto3 client the object layer uses, configured for bounded requests (see retry.py for why).

botocore's retries are off (``total_max_attempts=1``: retry.py decides), the socket timeout is the stall timeout,
and request checksums are the SHA-256 values the object layer computes (not botocore's default CRC32 pass over
every body). boto3 is imported here only, so the engine works without it until an ``s3://`` URL is used.
"""

from __future__ import annotations

from ..errors import S3_EXTRA_HINT, MissingDependencyError
from .errors import S3ConfigError
from .url import S3Options

DEFAULT_REGION = "us-east-1"


def make_client(opts: S3Options):
    """A thread-safe boto3 S3 client for ``opts``; explicit fields win over the AWS environment and files."""
    try:
        import boto3
        from botocore import exceptions as bce
        from botocore.config import Config
    except ImportError as exc:
        raise MissingDependencyError(S3_EXTRA_HINT.format(missing=exc.name or exc)) from exc
    try:
        session = boto3.session.Session(
            aws_access_key_id=opts.access_key_id,
            aws_secret_access_key=opts.secret_access_key,
            aws_session_token=opts.session_token,
            region_name=opts.region,
            profile_name=opts.profile,
        )
    except bce.ProfileNotFound as exc:
        raise S3ConfigError(f"AWS profile {opts.profile!r} not found in the AWS config files: {exc}") from exc
    config = Config(
        connect_timeout=opts.connect_timeout_s,
        read_timeout=opts.stall_timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=opts.concurrency + 2,
        s3={"addressing_style": opts.addressing_style},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        tcp_keepalive=True,
    )
    return session.client(
        "s3", endpoint_url=opts.endpoint_url, region_name=session.region_name or DEFAULT_REGION, config=config
    )
