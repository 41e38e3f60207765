"""Worker-side comparison of saved and loaded state: host copies of a state dict's values, compared bit for bit."""

from __future__ import annotations

import numpy as np


def host_values(state: dict) -> dict[str, np.ndarray]:
    """Each value's local tensor (a ShardedWeight's ``local_tensor``) as a host array."""
    return {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in state.items()}


def assert_bit_equal(got: dict, want: dict, what: str) -> None:
    """The same keys, and every array byte-identical (NaN payloads and -0.0 included)."""
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for k in want:
        assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), f"{what}: {k} differs"
