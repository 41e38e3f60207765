"""The S3 object layer: the few object operations a checkpoint needs, each bounded in time and named on failure.

Why one class: the storage backend (and tests, tools) speak objects under one ``s3://bucket/prefix``; retries,
deadlines, checksums and the abort of failed multipart uploads live here once. Names are relative to the prefix.

* ``upload(name, pieces)``: one object from a sequence of bytes-like pieces, sent from them without copies;
  multipart (parallel parts, a CRC32 or SHA-256 per part checked by the store) above one part size. Any failure, or an
  interrupt, aborts the multipart upload before the error is raised: no orphan parts left billing.
* ``put(name, data, if_absent=True)``: the commit: If-None-Match: * so that of two writers one wins and the other
  gets S3CommitConflictError.
* ``read_ranges(name, ranges, out)``: ranged GETs in parallel, straight into the caller's buffers; a read cut
  mid-body resumes from the byte reached.
* ``list``, ``size``, ``delete``, ``pending_uploads``, ``abort_pending``, ``check_bucket``.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from . import retry
from .body import PART_CHECKSUMS, ChainBody, as_views, part_checksum, split_parts
from .client import make_client
from .errors import (
    S3BucketNotFoundError,
    S3CommitConflictError,
    S3ConfigError,
    S3EndpointError,
    S3Error,
    S3ObjectTruncatedError,
)
from .url import S3Options, S3Url

LOG = logging.getLogger(__name__)
READ_CHUNK = 1 << 20  # bytes copied per read() of a GET body into the destination
DELETE_BATCH = 1000  # S3's DeleteObjects limit


@dataclass(frozen=True)
class UploadResult:
    """What was stored: key, size, and the checksum per part (base64, as the store checked them: ``algorithm``,
    S3Options.part_checksum)."""

    key: str
    size: int
    part_checksums: tuple[str, ...]
    etag: str
    algorithm: str = "crc32"


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int


class S3Objects:
    """Objects under one ``s3://bucket/prefix``. Thread-safe; ``close()`` (or ``with``) releases the threads.

    ``who`` (e.g. ``"rank 3"``) starts every error message, so a failure names the rank as well as the object."""

    def __init__(self, url: S3Url | str, options: S3Options | None = None, who: str = "") -> None:
        self.url = S3Url.parse(url) if isinstance(url, str) else url
        if not isinstance(self.url, S3Url):
            raise S3ConfigError(f"url must be an s3:// str or S3Url, got {type(url).__name__}")
        self.opts = options if options is not None else S3Options()
        if not isinstance(self.opts, S3Options):
            raise S3ConfigError(f"options must be S3Options, got {type(options).__name__}")
        self.who = f"{who}: " if who else ""
        self.client = make_client(self.opts)
        self._pool = cf.ThreadPoolExecutor(self.opts.concurrency, thread_name_prefix="s3")
        self._count_lock = threading.Lock()
        self.bytes_read = 0  # body bytes received by GETs (retried bytes counted again): what a load fetched

    def __enter__(self) -> S3Objects:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _what(self, op: str, name: str = "") -> str:
        where = f"s3://{self.url.bucket}/{self.url.key(name)}" if name else str(self.url)
        return f"{self.who}{op} {where}"

    # -- bucket ------------------------------------------------------------------------------------------------
    def check_bucket(self) -> None:
        """Fail fast with S3EndpointError / S3BucketNotFoundError / S3AccessDeniedError before any transfer."""
        what = self._what("HeadBucket")
        try:
            retry.call(what, lambda: self.client.head_bucket(Bucket=self.url.bucket), self.opts)
        except retry.S3ObjectNotFoundError as exc:  # HeadBucket's 404 has no code: it is the bucket
            raise S3BucketNotFoundError(f"{what}: the bucket does not exist (endpoint {self.endpoint})") from exc
        except S3EndpointError as exc:
            raise S3EndpointError(f"{exc} (endpoint {self.endpoint})") from exc

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    # -- writes ------------------------------------------------------------------------------------------------
    def put(self, name: str, data: object, *, if_absent: bool = False, if_match: str | None = None) -> UploadResult:
        """One PUT of a small object (<= 5 GiB) with its SHA-256; ``if_absent``: only if no object has the name;
        ``if_match``: only if the object's ETag is still this one (compare-and-swap).

        A conditional put whose earlier try may have succeeded unseen (a reply lost) and then meets 412 compares
        the stored bytes with ``data``: the same bytes are this writer's own success, not a conflict."""
        views = as_views(data)
        key, (field, digest) = self.url.key(name), part_checksum(self.opts.part_checksum, views)
        if if_absent and if_match is not None:
            raise S3ConfigError("put: if_absent and if_match exclude each other")
        cond = " If-None-Match:*" if if_absent else f" If-Match:{if_match}" if if_match else ""
        what = self._what("PutObject" + cond, name)
        tries = [0]

        def once() -> dict:
            tries[0] += 1
            kw = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_match} if if_match else {}
            body = ChainBody(views)
            return self.client.put_object(
                Bucket=self.url.bucket, Key=key, Body=body, ContentLength=len(body), **{field: digest}, **kw
            )

        try:
            reply = retry.call(what, once, self.opts)
        except S3Error as exc:
            if not ((if_absent or if_match) and _precondition_failed(exc)):
                raise
            if tries[0] > 1 and self._holds(name, views):
                LOG.info("%s: 412 after a retry, and the object holds our bytes: our earlier try succeeded", what)
                return UploadResult(key, sum(len(v) for v in views), (digest,), "", self.opts.part_checksum)
            raise S3CommitConflictError(
                f"{what}: another writer {'created' if if_absent else 'replaced'} the object first (412)"
            ) from exc
        return UploadResult(key, sum(len(v) for v in views), (digest,), reply.get("ETag", ""), self.opts.part_checksum)

    def _holds(self, name: str, views: list[memoryview]) -> bool:
        size = sum(len(v) for v in views)
        if self.size(name) != size:
            return False
        got = self.read_ranges(name, [(0, size)])[0]
        want = hashlib.sha256()
        for v in views:
            want.update(v)
        return hashlib.sha256(got).digest() == want.digest()

    def upload(self, name: str, pieces: Sequence[object]) -> UploadResult:
        """Store the concatenation of ``pieces`` as one object; multipart above ``part_size``. All or nothing."""
        views = as_views(pieces)
        size = sum(len(v) for v in views)
        if size <= self.opts.part_size:
            return self.put(name, views)
        self.opts.parts_for(size)  # refuses > 10,000 parts before anything is sent
        key = self.url.key(name)
        what = self._what("multipart upload", name)
        created = retry.call(
            what + " (create)",
            lambda: self.client.create_multipart_upload(
                Bucket=self.url.bucket, Key=key, ChecksumAlgorithm=PART_CHECKSUMS[self.opts.part_checksum][0]
            ),
            self.opts,
        )
        upload_id = created["UploadId"]
        try:
            parts = self._send_parts(name, key, upload_id, split_parts(views, self.opts.part_size))
            done = retry.call(
                what + " (complete)",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.url.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
                self.opts,
            )
        except BaseException as exc:
            self._abort(key, upload_id, what, exc)
            raise
        field = PART_CHECKSUMS[self.opts.part_checksum][1]
        return UploadResult(key, size, tuple(p[field] for p in parts), done.get("ETag", ""), self.opts.part_checksum)

    def _send_parts(self, name: str, key: str, upload_id: str, parts: list[list[memoryview]]) -> list[dict]:
        """Send the parts, at most ``concurrency`` in flight; the first fatal error cancels the others."""
        cancel = threading.Event()

        def send(number: int, slices: list[memoryview]) -> dict:
            field, digest = part_checksum(self.opts.part_checksum, slices)
            what = self._what(f"UploadPart {number}/{len(parts)} of upload {upload_id[:16]}", name)

            def once() -> dict:
                body = ChainBody(slices)
                return self.client.upload_part(
                    Bucket=self.url.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body,
                    ContentLength=len(body), **{field: digest},
                )  # fmt: skip

            reply = retry.call(what, once, self.opts, cancel=cancel)
            return {"PartNumber": number, "ETag": reply["ETag"], field: digest}

        futures = [self._pool.submit(send, i + 1, s) for i, s in enumerate(parts)]
        first_error: BaseException | None = None
        for fut in cf.as_completed(futures):
            exc = fut.exception()
            if exc is not None and (first_error is None or isinstance(first_error, retry.Cancelled)):
                first_error = exc
                cancel.set()
                for f in futures:
                    f.cancel()
        if first_error is not None:
            raise first_error
        return [f.result() for f in futures]

    def _abort(self, key: str, upload_id: str, what: str, cause: BaseException) -> None:
        """Abort a failed multipart upload (bounded retries); a failure to abort is logged and noted on ``cause``."""
        try:
            retry.call(
                what + " (abort)",
                lambda: self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=key, UploadId=upload_id),
                self.opts,
            )
            LOG.warning("%s: aborted upload %s after: %s", what, upload_id, cause)
        except S3Error as abort_exc:
            LOG.error("%s: could not abort upload %s: %s", what, upload_id, abort_exc)
            cause.add_note(f"the multipart upload {upload_id} could not be aborted either: {abort_exc}")

    # -- reads -------------------------------------------------------------------------------------------------
    def read_ranges(
        self, name: str, ranges: Sequence[tuple[int, int]], out: Sequence[memoryview] | None = None
    ) -> list[memoryview]:
        """Bytes [start, end) of each range, read in parallel (ranges above part_size in several GETs) into
        ``out`` (writable buffers of the ranges' lengths) or new buffers. S3ObjectTruncatedError if short."""
        if out is not None and len(out) != len(ranges):
            raise S3ConfigError(f"read_ranges: {len(ranges)} ranges but {len(out)} output buffers")
        dests = []
        for i, (start, end) in enumerate(ranges):
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
                raise S3ConfigError(f"read_ranges: bad range {i}: ({start!r}, {end!r})")
            buf = memoryview(bytearray(end - start)) if out is None else memoryview(out[i]).cast("B")
            if buf.readonly or len(buf) != end - start:
                raise S3ConfigError(f"read_ranges: output {i} must be writable and {end - start} bytes long")
            dests.append(buf)
        jobs = []
        for (start, end), buf in zip(ranges, dests):
            for off in range(start, end, self.opts.part_size):
                stop = min(off + self.opts.part_size, end)
                jobs.append((off, buf[off - start : stop - start]))
        cancel = threading.Event()
        futures = [self._pool.submit(self._get_into, name, off, dest, cancel) for off, dest in jobs]
        try:
            for fut in cf.as_completed(futures):
                if fut.exception() is not None:
                    cancel.set()
                    raise fut.exception()
        finally:
            cancel.set()
            cf.wait(futures)
        return dests

    def _get_into(self, name: str, start: int, dest: memoryview, cancel: threading.Event) -> None:
        """One ranged GET into ``dest``; a try cut mid-body is resumed by the next from the byte reached."""
        key, end = self.url.key(name), start + len(dest)
        done = [0]  # bytes in place, shared by the tries
        what = self._what(f"GetObject bytes={start}-{end - 1}", name)

        def once() -> None:
            lo = start + done[0]
            try:
                reply = self.client.get_object(Bucket=self.url.bucket, Key=key, Range=f"bytes={lo}-{end - 1}")
            except Exception as exc:
                if retry.error_code(exc)[1] == 416:
                    raise S3ObjectTruncatedError(f"{what}: the object ends before byte {lo}") from exc
                raise
            body = reply["Body"]
            try:
                while done[0] < len(dest):
                    chunk = body.read(min(READ_CHUNK, len(dest) - done[0]))
                    if not chunk:
                        raise S3ObjectTruncatedError(f"{what}: the object ends at byte {start + done[0]}")
                    dest[done[0] : done[0] + len(chunk)] = chunk
                    with self._count_lock:
                        self.bytes_read += len(chunk)
                    done[0] += len(chunk)
            finally:
                body.close()

        retry.call(what, once, self.opts, cancel=cancel)

    def read(self, name: str) -> bytes:
        """A whole (small) object."""
        size = self.size(name)
        if size is None:
            raise retry.S3ObjectNotFoundError(f"{self._what('GetObject', name)}: no such object")
        return bytes(self.read_ranges(name, [(0, size)])[0]) if size else b""

    def size(self, name: str) -> int | None:
        """Size of an object, None if it does not exist."""
        what = self._what("HeadObject", name)
        try:
            head = retry.call(
                what, lambda: self.client.head_object(Bucket=self.url.bucket, Key=self.url.key(name)), self.opts
            )
        except retry.S3ObjectNotFoundError:
            return None
        return int(head["ContentLength"])

    # -- listing and deletion ----------------------------------------------------------------------------------
    def list(self, sub: str = "") -> list[ObjectInfo]:
        """Every object under the prefix (or under ``sub`` below it), names relative to the prefix."""
        base = self.url.key(sub) + "/" if sub else (self.url.prefix + "/" if self.url.prefix else "")
        cut = len(self.url.prefix) + 1 if self.url.prefix else 0
        found, token = [], None
        while True:  # each page is one request with its own retries (a paginator would end silently on error)
            kw = {"ContinuationToken": token} if token else {}
            page = retry.call(
                self._what("ListObjectsV2", sub),
                lambda kw=kw: self.client.list_objects_v2(Bucket=self.url.bucket, Prefix=base, **kw),
                self.opts,
            )
            found += [ObjectInfo(o["Key"][cut:], int(o["Size"])) for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return found

    def list_level(self, sub: str) -> tuple[list[ObjectInfo], list[str]]:
        """(objects directly under ``sub``, names of the "directories" directly under it): a "/"-delimited listing."""
        base = self.url.key(sub) + "/" if sub else (self.url.prefix + "/" if self.url.prefix else "")
        objs, dirs, token = [], [], None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            page = retry.call(
                self._what("ListObjectsV2 /", sub),
                lambda kw=kw: self.client.list_objects_v2(Bucket=self.url.bucket, Prefix=base, Delimiter="/", **kw),
                self.opts,
            )
            objs += [ObjectInfo(o["Key"][len(base) :], int(o["Size"])) for o in page.get("Contents", [])]
            dirs += [p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return objs, dirs

    def get_small(self, name: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of a small object in one GET, None if it does not exist."""

        def once() -> tuple[bytes, str]:
            reply = self.client.get_object(Bucket=self.url.bucket, Key=self.url.key(name))
            with reply["Body"] as body:
                return body.read(), str(reply["ETag"])

        try:
            return retry.call(self._what("GetObject", name), once, self.opts)
        except retry.S3ObjectNotFoundError:
            return None

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects (absent ones are fine); S3TransferError naming the keys the store refused."""
        keys = [self.url.key(n) for n in names]
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i : i + DELETE_BATCH]]
            what = self._what(f"DeleteObjects ({len(batch)} keys)")
            reply = retry.call(
                what,
                lambda b=batch: self.client.delete_objects(
                    Bucket=self.url.bucket, Delete={"Objects": b, "Quiet": True}
                ),
                self.opts,
            )
            if reply.get("Errors"):
                errs = ", ".join(f"{e.get('Key')}: {e.get('Code')}" for e in reply["Errors"][:5])
                raise retry.S3TransferError(f"{what}: {len(reply['Errors'])} not deleted ({errs})")

    def pending_uploads(self, sub: str = "") -> list[tuple[str, str]]:
        """(key, upload id) of every multipart upload begun and not completed or aborted under the prefix."""
        base = self.url.key(sub) if sub else self.url.prefix
        found, marker = [], {}
        while True:
            page = retry.call(
                self._what("ListMultipartUploads", sub),
                lambda m=marker: self.client.list_multipart_uploads(Bucket=self.url.bucket, Prefix=base, **m),
                self.opts,
            )
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
            if not page.get("IsTruncated"):
                return found
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    def abort_pending(self, sub: str = "") -> int:
        """Abort every pending multipart upload under the prefix (after a writer was killed); returns the count."""
        pending = self.pending_uploads(sub)
        for key, upload_id in pending:
            what = f"{self.who}AbortMultipartUpload s3://{self.url.bucket}/{key} {upload_id[:16]}"
            retry.call(
                what,
                lambda k=key, u=upload_id: self.client.abort_multipart_upload(
                    Bucket=self.url.bucket, Key=k, UploadId=u
                ),
                self.opts,
            )
        return len(pending)


def _precondition_failed(exc: BaseException) -> bool:
    cause = exc.__cause__
    code, status = retry.error_code(cause) if cause is not None else ("", 0)
    return status == 412 or code == "PreconditionFailed"
