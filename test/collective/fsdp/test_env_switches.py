"""Every environment switch (env_switches.SWITCHES) x every spelling x garbage (issue #50 item 5).

The switches are enumerated from the package's table, and the package's sources are grepped so that no module
reads a ``PADDLE_FSDP_*`` variable around the table: a new switch cannot escape this test. Each switch is also
read through the code that uses it (CheckpointOptions.from_env, DeviceOptions.from_env, the collective order
check, the emulated delay, the memory tier, the activator), in-process: the behaviour is per process.
"""

from __future__ import annotations

import ast
import itertools
import math
import os
import re
from pathlib import Path

import pytest
from paddle.distributed.fsdp import env_switches
from paddle.distributed.fsdp.checkpoint.errors import CheckpointEnvError, CheckpointError
from paddle.distributed.fsdp.checkpoint.options import ENV_PREFIX, CheckpointOptions
from paddle.distributed.fsdp.comm import comm_emulation, communication
from paddle.distributed.fsdp.devices.device import DeviceOptions
from paddle.distributed.fsdp.env_switches import SWITCHES, EnvSwitchError

import paddle_fsdp_fork_activate as activator

ROOT = Path(__file__).resolve().parents[3] / "python"
PACKAGE = ROOT / "paddle" / "distributed" / "fsdp"
TRUE = ["1", "true", "yes", "on"]
FALSE = ["0", "false", "no", "off"]
GARBAGE = ["2", "-1", "maybe", "enabled", "1.5", "nan", "inf", "0x10", "tru", "o n", "yes please", "\x00"]


def _cases(word: str) -> list[str]:
    """``word`` in every case and with blanks around it."""
    return sorted({word, word.upper(), word.capitalize(), word.swapcase(), f"  {word}\t", word.title()})


def _env_reads() -> dict[str, set[str]]:
    """File -> the PADDLE_FSDP_* names (or constants) it reads from os.environ / os.getenv, by parsing."""
    out: dict[str, set[str]] = {}
    for path in [*PACKAGE.rglob("*.py"), ROOT / "paddle_fsdp_fork_activate.py"]:
        text = path.read_text()
        for m in re.finditer(r"(?:os\.environ(?:\.get)?|os\.getenv|environ\.get)\s*[\(\[]\s*([^,\)\]]+)", text):
            out.setdefault(str(path.relative_to(ROOT)), set()).add(m.group(1).strip())
    return out


def test_no_module_reads_a_switch_around_the_table():
    """Only env_switches.py (and the activator, which cannot import it) read PADDLE_FSDP_* variables; every
    PADDLE_FSDP_* name in the sources is a declared switch."""
    allowed_readers = {"paddle/distributed/fsdp/env_switches.py", "paddle_fsdp_fork_activate.py"}
    outside = {"PADDLE_TRAINER_ID", "MASTER_ADDR", "MASTER_PORT", "PADDLE_MASTER", "PADDLE_TRAINER_ENDPOINTS"}
    outside |= {"PADDLE_LOCAL_SIZE", "PADDLE_CURRENT_ENDPOINT"}  # paddle's launcher's, not switches
    for path, names in _env_reads().items():
        if path in allowed_readers:
            continue
        for name in names:
            assert name.strip("\"'") in outside, f"{path} reads {name} from the environment: declare it in SWITCHES"
    mentioned = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                mentioned |= set(re.findall(r"\bPADDLE_FSDP_[A-Z0-9_]*[A-Z0-9]\b", node.value))
    undeclared = {n for n in mentioned if n not in SWITCHES and not n.startswith(ENV_PREFIX + "*")}
    undeclared -= {"PADDLE_FSDP_CKPT"}  # the prefix itself, in prose
    assert not undeclared, f"PADDLE_FSDP_* names in the package that are not declared switches: {undeclared}"
    assert {"PADDLE_FSDP_FORK_DISABLE", "PADDLE_FSDP_FORK_SKIP_VERSION_CHECK"} <= set(SWITCHES)


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_every_switch_every_spelling_and_garbage(name):
    sw = SWITCHES[name]
    for empty in (None, "", "  ", "\t"):
        assert env_switches.read(name, {} if empty is None else {name: empty}) == sw.default, (name, empty)
    if sw.kind == "text":
        assert env_switches.read(name, {name: " /x/y "}) == "/x/y"
        return
    want = {}
    if sw.kind in ("bool", "mode") or sw.bool_aliases:
        one, zero = (1, 0) if sw.kind == "int" else (True, False)
        want.update({c: one for w in TRUE for c in _cases(w)})
        want.update({c: zero for w in FALSE for c in _cases(w)})
    if sw.kind == "mode":
        want.update({c: "auto" for c in _cases("auto")})
    if sw.kind == "choice":
        want.update({c: c.strip().lower() for w in sw.choices for c in _cases(w)})
    if sw.kind in ("int", "float"):
        lo = max(math.ceil(sw.minimum or 0), 1 if sw.kind == "float" else 0)
        typed = int if sw.kind == "int" else float
        want.update({str(lo): typed(lo), f" {lo + 7} ": typed(lo + 7)})
        if sw.kind == "float":
            want[f"{lo}.5"] = lo + 0.5
    for raw, value in want.items():
        got = env_switches.read(name, {name: raw})
        assert got == value and type(got) is type(value), (name, raw, got)
    garbage = [g for g in GARBAGE if g.strip().lower() not in {k.strip().lower() for k in want}]
    if sw.kind in ("int", "float"):
        garbage = [g for g in garbage if not _in_range(sw, g)] + [str(int(sw.minimum or 0) - 1)]
        if sw.kind == "int":
            garbage.append(f"{int(sw.minimum or 0) + 1}.5")
    if sw.kind in ("bool", "mode", "choice"):
        garbage += ["auto"] if sw.kind != "mode" and "auto" not in sw.choices else []
    for raw in garbage:
        with pytest.raises(EnvSwitchError) as err:
            env_switches.read(name, {name: raw})
        msg = str(err.value)
        assert name in msg and repr(raw) in msg and "expected" in msg, msg


def _in_range(sw, raw: str) -> bool:
    try:
        v = int(raw) if sw.kind == "int" else float(raw)
    except ValueError:
        return False
    return v == v and abs(v) != float("inf") and v >= (sw.minimum or 0)


# ------------------------------------------------------------------ through the code that reads each switch
def _options_field(name: str) -> str:
    from paddle.distributed.fsdp.checkpoint.options import _ENV_FIELDS

    return _ENV_FIELDS[name[len(ENV_PREFIX) :]]


CKPT_SWITCHES = sorted(n for n in SWITCHES if n.startswith(ENV_PREFIX))


def test_checkpoint_options_cover_every_ckpt_switch_with_the_same_defaults():
    from paddle.distributed.fsdp.checkpoint.options import _ENV_FIELDS

    assert sorted(ENV_PREFIX + k for k in _ENV_FIELDS) == CKPT_SWITCHES
    default = CheckpointOptions()
    for name in CKPT_SWITCHES:
        assert getattr(default, _options_field(name)) == SWITCHES[name].default, name
    assert CheckpointOptions.from_env({}) == default
    assert CheckpointOptions.from_env(dict.fromkeys(CKPT_SWITCHES, " ")) == default


@pytest.mark.parametrize("name", CKPT_SWITCHES)
def test_checkpoint_options_read_what_the_user_wrote(name):
    """The issue's cases (IN_PLACE=false gave True, ODIRECT=off gave auto, TRACE=on gave False) and every
    other spelling, through CheckpointOptions.from_env; garbage is a CheckpointEnvError (a CheckpointError and
    a ValueError) naming the variable."""
    sw, field = SWITCHES[name], _options_field(name)
    if sw.kind in ("bool", "mode"):
        for word, value in itertools.chain(((w, True) for w in TRUE), ((w, False) for w in FALSE)):
            for spelled in _cases(word):
                assert getattr(CheckpointOptions.from_env({name: spelled}), field) is value, (name, spelled)
    for raw in ("garbage", "-5", "2.5.1"):
        with pytest.raises(CheckpointEnvError, match=name) as err:
            CheckpointOptions.from_env({name: raw})
        assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)


def test_the_issue_cases():
    opts = CheckpointOptions.from_env
    assert opts({ENV_PREFIX + "IN_PLACE": "false"}).in_place is False
    assert opts({ENV_PREFIX + "IN_PLACE": "OFF"}).in_place is False
    assert opts({ENV_PREFIX + "ODIRECT": "false"}).odirect is False
    assert opts({ENV_PREFIX + "ODIRECT": "Auto"}).odirect == "auto"
    assert opts({ENV_PREFIX + "HUGEPAGES": "no"}).hugepages is False
    assert opts({ENV_PREFIX + "TRACE": "true"}).trace is True
    assert opts({ENV_PREFIX + "TRACE": "on"}).trace is True


@pytest.mark.parametrize(
    "name,read",
    [
        ("PADDLE_FSDP_FAKE_DEVICE", lambda: DeviceOptions.from_env().fake_device),
        ("PADDLE_FSDP_EMULATE_GPU_COLLECTIVES", lambda: DeviceOptions.from_env().emulate_gpu_collectives),
        ("PADDLE_FSDP_CHECK_COLLECTIVE_ORDER", lambda: bool(communication.check_interval_from_env())),
    ],
)
def test_the_training_core_switches_through_their_readers(monkeypatch, name, read):
    for words, value in ((TRUE, True), (FALSE, False)):
        for spelled in (c for w in words for c in _cases(w)):
            monkeypatch.setenv(name, spelled)
            assert read() is value, (name, spelled)
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(EnvSwitchError, match=name):
        read()
    monkeypatch.setenv("PADDLE_FSDP_CHECK_COLLECTIVE_ORDER", "7")
    assert communication.check_interval_from_env() == 7


def test_delay_and_memtier_quota_name_bad_numbers(monkeypatch, tmp_path):
    from paddle.distributed.fsdp.memtier.errors import MemoryTierEnvError, MemoryTierError
    from paddle.distributed.fsdp.memtier.manager import MemoryTier

    monkeypatch.setenv(comm_emulation.DELAY_ENV, "250")
    assert comm_emulation.delay_from_env() == 0.25
    for raw in ("-1", "soon", "nan"):
        monkeypatch.setenv(comm_emulation.DELAY_ENV, raw)
        with pytest.raises(EnvSwitchError, match=comm_emulation.DELAY_ENV):
            comm_emulation.delay_from_env()
    for raw in ("-1", "lots", "1.5", "inf"):
        monkeypatch.setenv("PADDLE_FSDP_MEMTIER_QUOTA", raw)
        with pytest.raises(MemoryTierEnvError, match="PADDLE_FSDP_MEMTIER_QUOTA") as err:
            MemoryTier(None, durable_root=str(tmp_path / "durable"), memory_root=str(tmp_path / "mem"))
        assert isinstance(err.value, MemoryTierError) and isinstance(err.value, CheckpointEnvError)


def test_the_activator_reads_its_switches_with_the_same_spellings(monkeypatch, caplog):
    """paddle_fsdp_fork_activate cannot import env_switches (it runs before the overlay exists): its reader
    agrees with ``read`` on every spelling; garbage is a warning naming the variable, read as off."""
    for name in (activator.DISABLE_ENV, activator.SKIP_VERSION_CHECK_ENV):
        assert name in SWITCHES
        for spelled in [c for w in TRUE + FALSE for c in _cases(w)] + ["", "  "]:
            monkeypatch.setenv(name, spelled)
            assert activator._switch(name) is env_switches.read(name), (name, spelled)
        monkeypatch.setenv(name, "perhaps")
        monkeypatch.setattr(activator, "_warned_switches", set())
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert activator._switch(name) is False
        assert name in caplog.text and "perhaps" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert activator._switch(name) is False
        assert caplog.text == "", "warned twice about the same value"
        monkeypatch.delenv(name)
        assert activator._switch(name) is False
    assert os.environ.get(activator.DISABLE_ENV) is None
