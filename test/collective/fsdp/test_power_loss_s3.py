"""Power loss of the saving client on an object store (#54), against the real S3 server (SeaweedFS).

What a client's power loss is to the server: the client stops after some request. Every request the server
acknowledged stays (an acknowledged PUT is stored whole, S3 never adds a partial object); nothing after it
arrives. So the crash states of an ``s3://`` save are the prefixes of its request sequence: a fault proxy
(s3_fault_proxy.py) forwards the first ``k`` requests of the save of step 2 and resets every later one (retries
and cleanup included: a client without power sends nothing), for every ``k`` from 0 to the save's length.
Per state, read straight from the server: the checkpoint a resume picks loads bit-exactly as step 1 or step 2
(step 2 once the whole save went through) and every checkpoint with a commit record passes verify.

What this cannot show: the server's own power loss (its durability is the service's, docs/reliability.md).
"""

from __future__ import annotations

import random
import re
import time

import crash_explore
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint.format.metadata import COMMIT_FILE
from paddle.distributed.fsdp.checkpoint.io import backends as backends_mod
from s3_fault_proxy import Rule
from s3_fixtures import s3_options_for
from test_power_loss_posix import _loads_as, _state

pytestmark = pytest.mark.power_loss


class Cutoff:
    """A proxy rule's match: true (reset) for every request after the first ``k`` it sees."""

    def __init__(self, k: int):
        self.k, self.seen = k, 0

    def __call__(self, method: str, target: str) -> bool:
        self.seen += 1
        return self.seen > self.k


def _save_step_2(url: str, k: int | None, proxy) -> int:
    """Save step 1 whole, then step 2 with only its first ``k`` requests reaching the server (None: all).
    Returns the requests the save of step 2 sent."""
    ck.CheckpointManager(url, keep_last=1).save(1, _state(1))
    cut = proxy.add(Rule(Cutoff(k if k is not None else 1 << 30), "reset"))
    try:
        ck.CheckpointManager(url, keep_last=1).save(2, _state(2))
    except Exception:  # noqa: BLE001 - the client "lost power": whatever it raises, it sends nothing more
        assert k is not None
    finally:
        proxy.rules.remove(cut)
    return cut.match.seen


def _check(url: str, whole: bool, store) -> int:
    picked = ck.latest_checkpoint(url)
    assert picked is not None, f"{url}: no checkpoint to resume from after the save of step 1 had returned"
    step = _loads_as(picked)
    assert step == 2 or not whole, f"{url}: step {step} picked after the save of step 2 went through"
    for name in store.children(url):
        location = store.child(url, name)
        if name.startswith("step_") and COMMIT_FILE in store.list(location):
            problems = ck.verify_checkpoint(location)
            assert not problems, f"{location} has a commit record but fails verify: {problems[:3]}"
    return step


def test_every_request_prefix_of_an_s3_save_resumes(s3_server, fault_proxy, s3_bucket, monkeypatch):
    """Prefixes replayed: none and all of the save's requests, both sides of the requests that write the commit
    record and ``latest``, and a seeded sample of the rest (PADDLE_FSDP_CRASH_STATES of them in all, default 6:
    3-6 s each here, two saves through the proxy; the seed is printed)."""
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage

    fast = dict(max_attempts=1, retry_deadline_s=0.5, backoff_base_s=0.01, backoff_max_s=0.05)
    via, direct = S3Storage(s3_options_for(fault_proxy.endpoint, **fast)), S3Storage(s3_options_for(s3_server.endpoint))
    use = {"store": via}
    monkeypatch.setitem(backends_mod._schemes, "s3", lambda: use["store"])
    t0 = time.monotonic()
    start = len(fault_proxy.log)
    total = _save_step_2(f"s3://{s3_bucket}/whole", None, fault_proxy)
    requests = fault_proxy.log[start:][-total:]
    use["store"] = direct
    assert _check(f"s3://{s3_bucket}/whole", True, direct) == 2
    marks = [i for i, r in enumerate(requests) if r.method == "PUT" and re.search(r"/(COMMIT|latest)$", r.target)]
    assert marks, [f"{r.method} {r.target}" for r in requests]
    rng = random.Random(crash_explore.seed())
    plan = {0, total} | {k for i in marks for k in (i, i + 1)}
    rest = sorted(set(range(total + 1)) - plan)
    plan |= set(rng.sample(rest, max(0, min(len(rest), crash_explore.budget(6) - len(plan)))))
    picked = {}
    for k in sorted(plan):
        url = f"s3://{s3_bucket}/cut{k}"
        use["store"] = via
        _save_step_2(url, k, fault_proxy)
        use["store"] = direct
        picked[k] = _check(url, k == total, direct)
    print(f"s3 save of step 2: {total} requests (commit record and latest at {marks}); {len(plan)} prefixes "
          f"replayed in {time.monotonic() - t0:.1f} s; step picked per prefix: {picked}")  # fmt: skip
    assert picked[total] == 2 and picked[0] == 1
