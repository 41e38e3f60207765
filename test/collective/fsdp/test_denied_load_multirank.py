"""A rank that cannot read the checkpoint's storage at a load or restart: every rank gets the same named error,
promptly (issue 40). Real processes (workers/denied_load.py), rank 1's reads denied with EACCES."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_util import run_launch

HERE = Path(__file__).resolve().parent
CASES = [f"{c}:{call}" for c in ("all", "objects", "data") for call in ("load_checkpoint", "load_state_dict")]
CASES += ["values:load_checkpoint"]


@pytest.fixture(scope="module")
def denied_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("denied")
    return run_launch(HERE / "workers" / "denied_load.py", 2, [str(work)], timeout=900, log_dir=work / "logs")


@pytest.mark.parametrize("case", CASES)
def test_every_rank_gets_the_same_named_error(denied_run, case):
    got = {r: denied_run.result(r)[case] for r in (0, 1)}
    (cls0, msg0, named0, _s0), (cls1, msg1, named1, _s1) = got[0], got[1]
    assert named0 and named1, got  # CheckpointError subclasses, never gloo's RuntimeError or a bare OSError
    assert cls0 == cls1 and cls0 != "CheckpointError", got  # the same named class on every rank
    assert "rank 1" in msg0 and "Permission denied" in msg0 + msg1, got  # the peer is told who failed and why
    assert max(got[0][3], got[1][3]) < 120, got


def test_a_fallback_is_decided_alike_on_every_rank(denied_run):
    """Data found damaged while reading step 2: both ranks fall back to step 1; when rank 1 cannot list the root
    at that moment, both raise PartiallyLoadedError saying so (rank 1 used to raise alone, rank 0 to load step 1
    and wait in a collective rank 1 never joined)."""
    sound = {r: denied_run.result(r)["fallback:sound"] for r in (0, 1)}
    assert all(v[:2] == ["none", "step 1"] for v in sound.values()), sound
    denied = {r: denied_run.result(r)["fallback:denied"] for r in (0, 1)}
    assert all(v[0] == "PartiallyLoadedError" and v[2] for v in denied.values()), denied
    assert all("Permission denied" in v[1] for v in denied.values()), denied


def test_a_flipped_bit_of_a_rows_file_is_named_on_both_ranks(denied_run):
    """One flipped bit in index.pieces (row 0's file): a 2-rank resume used to load another rank's bytes."""
    got = {r: denied_run.result(r)["flipped_row"] for r in (0, 1)}
    assert all(v[0] == "CorruptCheckpointError" and "index.pieces row 0 is damaged" in v[1] for v in got.values()), got


def test_a_peer_rebuilds_the_s3_error_class_of_the_failing_rank():
    """A rank denied by S3 raises S3AccessDeniedError; its peers get the same class (it used to be rebuilt as
    the base CheckpointError: only the engine's own classes were known to the exchange)."""
    from paddle.distributed.fsdp.checkpoint.coordination import gather_errors
    from paddle.distributed.fsdp.checkpoint.s3.errors import S3AccessDeniedError

    class Peer:  # rank 0's view of an exchange in which rank 1 failed
        def all_gather_object(self, obj):
            return [obj, (("S3AccessDeniedError", "GetObject of s3://b/ck/index.keys: 403 AccessDenied"), None)]

    with pytest.raises(S3AccessDeniedError, match="rank 1 failed: GetObject"):
        gather_errors(Peer(), None)
