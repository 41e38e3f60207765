"""tools/ckpt_bench/link_shaper.py: the tc commands it would run (built only; tc itself is not run here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from ckpt_bench import link_shaper  # noqa: E402


def test_filters_match_only_the_s3_port_both_directions():
    cmds = link_shaper.setup_commands(port=41234, mbit=400, tc="tc")
    root = cmds[0]
    assert root[:8] == ["tc", "qdisc", "add", "dev", "lo", "root", "handle", f"{link_shaper.HANDLE}:"]
    assert root[-2:] == ["default", "0"]  # unclassified traffic (every other port) passes unshaped
    classes = [c for c in cmds if c[1] == "class"]
    assert all(c[c.index("rate") + 1] == "400mbit" and c[c.index("ceil") + 1] == "400mbit" for c in classes)
    filters = [c for c in cmds if c[1] == "filter"]
    matched = {(c[c.index("match") + 2], c[c.index("match") + 3], c[c.index("flowid") + 1]) for c in filters}
    assert matched == {
        ("dport", "41234", link_shaper.UPLOAD_CLASS),
        ("sport", "41234", link_shaper.DOWNLOAD_CLASS),
    }
    assert link_shaper.teardown_command("tc")[-2:] == ["handle", f"{link_shaper.HANDLE}:"]


def test_rejects_a_bad_port_or_rate():
    with pytest.raises(ValueError):
        link_shaper.setup_commands(port=0, mbit=400)
    with pytest.raises(ValueError):
        link_shaper.setup_commands(port=9000, mbit=0)
