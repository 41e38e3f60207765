"""Engine options: one frozen object passed to save and load, instead of module globals.

``save_state_dict(..., options=CheckpointOptions(...))`` and ``load_state_dict(..., options=...)`` (also
``load_full_state_dict``, ``CheckpointManager.save`` / ``load_latest``, ``fsdp.save_checkpoint`` /
``load_checkpoint``). Without ``options`` the engine uses ``CheckpointOptions.from_env()``, which reads the
``PADDLE_FSDP_CKPT_*`` environment variables at call time (a variable set after import counts):

* ``checksum``: ``PADDLE_FSDP_CKPT_CHECKSUM``; default None (xxh3-64, crc32 without xxhash)
* ``checksum_threads``: ``PADDLE_FSDP_CKPT_CHECKSUM_THREADS``; default 2 (0: verify on the reading thread)
* ``commit_timeout``: ``PADDLE_FSDP_CKPT_COMMIT_TIMEOUT``; default 1800 s
* ``odirect``: ``PADDLE_FSDP_CKPT_ODIRECT`` (``auto`` or on/off); default "auto" (reads: by page-cache residency;
  writes: on)
* ``hugepages``: ``PADDLE_FSDP_CKPT_HUGEPAGES`` (``auto`` or on/off); default "auto" (O_DIRECT read buffers)
* ``in_place``: ``PADDLE_FSDP_CKPT_IN_PLACE`` (on/off); default True
* ``read_slab_bytes``: ``PADDLE_FSDP_CKPT_READ_SLAB``; default 16 MiB
* ``trace``: ``PADDLE_FSDP_CKPT_TRACE`` (on/off); default False
* ``derive_weights``: ``PADDLE_FSDP_CKPT_DERIVE_WEIGHTS`` (on/off); default True
* ``max_metadata_bytes``: ``PADDLE_FSDP_CKPT_MAX_METADATA_BYTES``; default 512 MiB
* ``max_open_files``: ``PADDLE_FSDP_CKPT_MAX_OPEN_FILES``; default 64
* ``heartbeat_lease``: ``PADDLE_FSDP_CKPT_HEARTBEAT_LEASE``; default 5 s
* ``codec``: ``PADDLE_FSDP_CKPT_CODEC`` (``auto``, ``raw``, ``byteplane-zstd``); default "auto" (compressed
  where this process's encoder outran the storage's measured write rate by 1.2x; before a first measurement at
  a storage root: compressed on object stores, raw on local disks: codec_choice.py)
* ``codec_threads``: ``PADDLE_FSDP_CKPT_CODEC_THREADS``; default 0 (this rank's share of the node's cores but one: cores.py)
* ``trace_hook``, ``storage``: no variable; default None

Spellings (env_switches.py, the one parser of every switch): booleans take 1/0, true/false, yes/no, on/off in
any case; an empty variable is the default; anything else (and a number out of range) is a
``CheckpointEnvError`` naming the variable and what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from .. import env_switches
from . import checksums, reader
from .errors import CheckpointEnvError, CheckpointError, ExtensionError
from .format import strict_json
from .io.storage import Storage
from .tracing import TraceHook

ENV_PREFIX = "PADDLE_FSDP_CKPT_"
# Encode threads a save may ask for: each holds ~2 chunks in flight and a thread is started per chunk queued, so
# codec_threads=10**6 started a thread for every chunk of a piece and held the whole piece encoded at once.
MAX_CODEC_THREADS = 1024
#: variable (after the prefix) -> field; each is declared in env_switches.SWITCHES
_ENV_FIELDS = {
    "CHECKSUM": "checksum",
    "CHECKSUM_THREADS": "checksum_threads",
    "COMMIT_TIMEOUT": "commit_timeout",
    "HEARTBEAT_LEASE": "heartbeat_lease",
    "READ_SLAB": "read_slab_bytes",
    "MAX_METADATA_BYTES": "max_metadata_bytes",
    "MAX_OPEN_FILES": "max_open_files",
    "ODIRECT": "odirect",
    "HUGEPAGES": "hugepages",
    "IN_PLACE": "in_place",
    "TRACE": "trace",
    "DERIVE_WEIGHTS": "derive_weights",
    "CODEC": "codec",
    "CODEC_THREADS": "codec_threads",
    "QUANTIZE_MOMENTS": "quantize_moments",
}


@dataclass(frozen=True)
class CheckpointOptions:
    """How the engine saves and loads (not what: that is the state dict and the path).

    Attributes:
        checksum: algorithm for new checkpoints, ``"xxh3-64"``, ``"crc32"`` or ``"none"``; None picks xxh3-64
            (crc32 when the xxhash package is missing). Loads use what the checkpoint says.
        checksum_threads: helper threads that verify chunks while later ones are read (0: on the reading
            thread). One pool per thread count, shared by the process.
        commit_timeout: seconds a save waits for the other ranks' data (coordinator) or for the commit (other
            ranks) before SaveFailedError.
        odirect: span reads of a load with O_DIRECT: ``"auto"`` when the file is mostly not in the page cache,
            True always, False never (where the OS or file system refuses it, buffered reads are used). Saves
            write their data files with O_DIRECT unless False (direct_write.py; buffered where refused).
        hugepages: transparent huge pages for host buffers: ``"auto"`` for buffers filled by O_DIRECT reads
            only, True for all, False never.
        in_place: a load reads whole saved pieces straight into contiguous host targets, with an undo copy
            (load/inplace.py); False stages them like every other target (for measurements).
        read_slab_bytes: bytes per pread of a large range (checksums of one slab overlap the next read).
        trace: print the phase timings of every save and load to stderr.
        trace_hook: called with a TraceRecord at the end of every save and load (and of a save's background
            part); for benchmarks. Runs on the thread that did the work; an exception it raises is logged as a
            warning naming it (the work it reports on succeeded). Not callable: ExtensionError.
        max_metadata_bytes: a ``metadata.json`` larger than this is refused (MetadataError) before it is read:
            parsing costs about ten times its size in memory. A real 30B-MoE index measured 246 MB.
        max_open_files: descriptors a reader keeps open at once (least recently used ones are closed), so any
            number of data files reads under a low RLIMIT_NOFILE.
        heartbeat_lease: seconds without a heartbeat (save/channel.py, through the TCP store) after which the other
            ranks of a save consider a rank dead (killed or frozen) and raise SaveFailedError naming it; a TCP store
            silent this long names rank 0, its host. Each store call has a third of it (0.5-5 s).
        quantize_moments: ``"int8"``/``"int4"``: ``save_checkpoint`` stores the optimizer moments lossily
            (lossy.py; its ``quantize_moments=`` argument wins); None or ``"none"``: exactly.
        storage: the storage backend (io/storage.py) that holds the checkpoint; None picks it from the path
            (a registered ``scheme://``, else the local POSIX backend with ``odirect`` writes).
        derive_weights: a save leaves out each bf16/fp16 weight ``<k>`` that is exactly its fp32 master weight
            ``<k>.master_weight`` cast (checked on every rank's shard; save/derive.py), and every load derives it
            (format 4's ``derived``: format/derived.py). False stores every weight (format 3).
        codec: how saves store their data files' chunks (format/codecs.py): ``"raw"``, ``"byteplane-zstd"``
            (lossless, ~1.2-1.5x smaller for bf16/fp32 training state), or ``"auto"``: compressed where the
            encoder (its threads) outruns the write rate this process's earlier saves measured at the same
            storage root by ``codec_choice.MARGIN`` (1.2x); at a root not yet measured, compressed on object
            stores and raw on a local disk (codec_choice.py). Loads read any.
        codec_threads: threads that encode a save's chunks, and that quantize (dequantize at load) its moments with
            ``quantize_moments`` (quant_threads.py); 0: the rank's share of the node's cores but one (cores.py).
    """

    checksum: str | None = None
    checksum_threads: int = reader.DEFAULT_CHECKSUM_THREADS
    commit_timeout: float = 1800.0
    odirect: bool | str = "auto"
    hugepages: bool | str = "auto"
    in_place: bool = True
    read_slab_bytes: int = reader.DEFAULT_READ_SLAB
    trace: bool = False
    trace_hook: TraceHook | None = field(default=None, compare=False)
    max_metadata_bytes: int = strict_json.DEFAULT_MAX_METADATA_BYTES
    max_open_files: int = reader.MAX_OPEN_FILES
    heartbeat_lease: float = 5.0
    quantize_moments: str | None = None
    storage: Storage | None = field(default=None, compare=False)
    derive_weights: bool = True
    codec: str = "auto"
    codec_threads: int = 0

    def __post_init__(self) -> None:
        from .codec_choice import CHOICES

        if self.codec not in CHOICES:
            raise CheckpointError(f"codec={self.codec!r}: expected one of {', '.join(CHOICES)}")
        if type(self.codec_threads) is not int or not 0 <= self.codec_threads <= MAX_CODEC_THREADS:
            raise CheckpointError(
                f"codec_threads={self.codec_threads!r:.40}: expected an integer from 0 (chosen: the rank's cores but one) "
                f"to {MAX_CODEC_THREADS}"
            )
        if self.checksum is not None and self.checksum not in checksums.KNOWN:
            raise CheckpointError(f"checksum={self.checksum!r}: expected one of {', '.join(checksums.KNOWN)}")
        for name in ("odirect", "hugepages"):
            if getattr(self, name) not in ("auto", True, False):
                raise CheckpointError(f"{name}={getattr(self, name)!r}: expected 'auto', True or False")
        if self.checksum_threads < 0:
            raise CheckpointError(f"checksum_threads must be >= 0, got {self.checksum_threads}")
        if self.read_slab_bytes <= 0:
            raise CheckpointError(f"read_slab_bytes must be positive, got {self.read_slab_bytes}")
        if not self.commit_timeout > 0:
            raise CheckpointError(f"commit_timeout must be positive, got {self.commit_timeout}")
        if not self.heartbeat_lease > 0:
            raise CheckpointError(f"heartbeat_lease must be positive, got {self.heartbeat_lease}")
        if self.trace_hook is not None and not callable(self.trace_hook):
            raise ExtensionError(f"trace_hook must be callable (TraceRecord -> None), got {self.trace_hook!r:.100}")
        if self.storage is not None and not isinstance(self.storage, Storage):
            raise CheckpointError(f"storage must be a Storage (io/storage.py), got {type(self.storage).__name__}")
        if self.quantize_moments not in (None, "none", "int8", "int4"):
            raise CheckpointError(
                f"quantize_moments={self.quantize_moments!r}: expected None, 'none', 'int8' or 'int4'"
            )
        if self.max_metadata_bytes <= 0 or self.max_open_files < 2:
            raise CheckpointError("max_metadata_bytes must be positive and max_open_files at least 2")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CheckpointOptions:
        """Options from the ``PADDLE_FSDP_CKPT_*`` variables of ``environ`` (default: ``os.environ``, read now);
        an unset variable keeps the default, a malformed one raises CheckpointError naming it."""
        env = os.environ if environ is None else environ
        kw: dict = {}
        for name, key in _ENV_FIELDS.items():
            if env.get(ENV_PREFIX + name, "").strip():  # unset or empty: the field's default
                kw[key] = env_switches.read(ENV_PREFIX + name, env, error=CheckpointEnvError)
        return cls(**kw)

    def replace(self, **changes) -> CheckpointOptions:
        """A copy with ``changes`` (the object itself is frozen); an unknown field is a TypeError naming the
        nearest one."""
        from ..keywords import check_keywords

        check_keywords("CheckpointOptions.replace", changes, [f.name for f in fields(self)])
        return replace(self, **changes)

    def storage_for(self, location: str) -> Storage:
        """The backend that holds ``location`` under these options (``storage``, a scheme, or local)."""
        from .io.backends import layered, unlayered_backend_for
        from .io.local import LOCAL, LocalStorage

        chosen = unlayered_backend_for(location, self.storage)
        if chosen is LOCAL and self.odirect is False:
            chosen = LocalStorage(odirect=False)
        return layered(chosen)

    def checksum_algorithm(self) -> str:
        """The algorithm a new checkpoint is written with (refuses xxh3-64 without xxhash before any write)."""
        return checksums.default_algorithm(self.checksum)


def resolve(options: CheckpointOptions | None) -> CheckpointOptions:
    """``options``, or the environment's when None (the documented fallback)."""
    return CheckpointOptions.from_env() if options is None else options
