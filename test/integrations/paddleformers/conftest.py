"""Tests of FSDPTrainer against the real PaddleFormers 1.2.0 (the ``paddleformers`` extra).

Not collected by the main suite (``test/collective/fsdp`` pins PaddleFormers 0.4.1, which cannot share a venv with
1.2.0): ``.ci/run`` runs them in a second venv, ``pip install ".[cpu,paddleformers]" pytest``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "collective" / "fsdp"), str(HERE.parents[2] / "examples")]

from s3_fixtures import s3_bucket, s3_env, s3_server  # noqa: E402, F401 - a real SeaweedFS (s3:// output dir)
