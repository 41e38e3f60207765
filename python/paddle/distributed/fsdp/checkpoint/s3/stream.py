"""One object written as a stream of buffers: parts go out while later pieces are still being produced.

Why: a rank's data object is its header plus pieces that may be produced one at a time (a device tensor copied
to host just before it is written). ``StreamUpload`` cuts the stream into parts of ``part_size`` made of slices
of the given buffers (no copy), sends up to ``concurrency`` parts at once and blocks the producer beyond that, so
host memory held for the upload is at most part_size x (concurrency + 1) of the producer's buffers. The
multipart upload is created only when a second part is needed (a small object is one PUT) and aborted on any
failure, by ``abort()`` or by leaving a ``with`` block with an exception.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

from . import retry
from .body import PART_CHECKSUMS, ChainBody, part_checksum
from .objects import S3Objects, UploadResult


class StreamUpload:
    """``write(view)`` buffers in order, then ``finish()``; or ``abort()``. Not thread-safe (one producer)."""

    def __init__(self, objects: S3Objects, name: str) -> None:
        self.o, self.name = objects, name
        self.key = objects.url.key(name)
        self.what = objects._what("multipart upload", name)
        self._pending: list[memoryview] = []
        self._keep: list[object] = []
        self._pending_bytes = 0
        self._upload_id: str | None = None
        self._futures: list[cf.Future] = []
        self._slots = threading.Semaphore(objects.opts.concurrency)
        self._cancel = threading.Event()
        self.size = 0

    def __enter__(self) -> StreamUpload:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort(exc)

    def write(self, view: memoryview, keep: object = None) -> None:
        """Queue ``view``'s bytes (kept referenced, not copied, until their part is sent); ``keep`` (the owner of
        the view's memory, e.g. a host copy of a device tensor) is held as long as the view."""
        view = memoryview(view).cast("B")
        part = self.o.opts.part_size
        off = 0
        while off < len(view):
            n = min(part - self._pending_bytes, len(view) - off)
            self._pending.append(view[off : off + n])
            self._keep.append(keep)
            self._pending_bytes += n
            off += n
            if self._pending_bytes == part and off <= len(view):
                self._flush_part()
        self.size += len(view)

    def _flush_part(self) -> None:
        """Send the pending slices as the next part (creates the upload on the first part)."""
        if self._upload_id is None:
            created = retry.call(
                self.what + " (create)",
                lambda: self.o.client.create_multipart_upload(
                    Bucket=self.o.url.bucket,
                    Key=self.key,
                    ChecksumAlgorithm=PART_CHECKSUMS[self.o.opts.part_checksum][0],
                ),
                self.o.opts,
            )
            self._upload_id = created["UploadId"]
        self._raise_failed()
        slices, keep, self._pending, self._keep, self._pending_bytes = self._pending, self._keep, [], [], 0
        number = len(self._futures) + 1
        self._slots.acquire()  # at most `concurrency` parts in flight: the producer waits here
        try:
            fut = self.o._pool.submit(self._send, number, slices, keep)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        self._futures.append(fut)

    def _send(self, number: int, slices: list[memoryview], _keep: list[object]) -> dict:
        field, digest = part_checksum(self.o.opts.part_checksum, slices)
        what = self.o._what(f"UploadPart {number} of upload {self._upload_id[:16]}", self.name)

        def once() -> dict:
            body = ChainBody(slices)
            return self.o.client.upload_part(
                Bucket=self.o.url.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=body,
                ContentLength=len(body), **{field: digest},
            )  # fmt: skip

        reply = retry.call(what, once, self.o.opts, cancel=self._cancel)
        return {"PartNumber": number, "ETag": reply["ETag"], field: digest}

    def _raise_failed(self) -> None:
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def finish(self) -> UploadResult:
        """Send the rest and complete; the object exists (whole) when this returns."""
        try:
            if self._upload_id is None:  # fits in one part: one PUT
                return self.o.put(self.name, self._pending)
            if self._pending_bytes:
                self._flush_part()
            cf.wait(self._futures)
            self._raise_failed()
            parts = [f.result() for f in self._futures]
            done = retry.call(
                self.what + " (complete)",
                lambda: self.o.client.complete_multipart_upload(
                    Bucket=self.o.url.bucket, Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                ),
                self.o.opts,
            )
            field = PART_CHECKSUMS[self.o.opts.part_checksum][1]
            sums = tuple(p[field] for p in parts)
            return UploadResult(self.key, self.size, sums, done.get("ETag", ""), self.o.opts.part_checksum)
        except BaseException as exc:
            self.abort(exc)
            raise

    def abort(self, cause: BaseException | None = None) -> None:
        """Stop the parts in flight and abort the multipart upload (idempotent)."""
        self._cancel.set()
        for fut in self._futures:
            fut.cancel()
        cf.wait(self._futures)
        self._pending, self._keep, self._pending_bytes = [], [], 0
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self.o._abort(self.key, upload_id, self.what, cause or RuntimeError("aborted"))
