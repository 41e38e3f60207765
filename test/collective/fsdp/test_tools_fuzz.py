"""Seeded mutation fuzzing of the inputs ``paddle-fsdp-ckpt`` reads besides our own checkpoints.

Hugging Face directories (index, safetensors headers and data) for ``from-hf``; ``config.json`` for ``--preset``;
rules files; stock paddle checkpoints (pickled ``*.metadata``, ``.distcp`` data) for ``inspect`` / ``verify`` /
``import-stock``; ``diff`` with one side crafted. Each mutation runs the CLI's ``main(argv)`` in this process and
asserts the contract: exit 0, 1 or 2; on 2 exactly one line on stderr naming the problem and no traceback; no
file created outside the output directory; the output directory either complete or absent (no ``OUT.tmp-*``
left). One case runs in a child under ``RLIMIT_AS`` to prove a header declaring a 100 GB tensor is never allocated.
The seed is printed with every failure (``FSDP_TOOLS_FUZZ_SEED``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stnp
from hangs import alarm
from paddle.distributed.fsdp.tools.cli import main as cli_main

SEED = int(os.environ.get("FSDP_TOOLS_FUZZ_SEED", "4242"))
ROUNDS = int(os.environ.get("FSDP_TOOLS_FUZZ_ROUNDS", "120"))
INDEX = "model.safetensors.index.json"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_cli(capsys, work: Path, args: list, out: Path | None, what: str):
    """Run the CLI; check exit code, stderr shape, nothing written outside ``out``, ``out`` complete or absent."""
    before = tree(work)
    capsys.readouterr()
    with alarm(20, what):
        rc = cli_main([str(a) for a in args])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    if rc == 3 and os.environ.get("FSDP_TOOLS_FUZZ_DEBUG"):  # show the traceback of the internal error
        cli_main([str(a) for a in args] + ["--debug"])
    assert rc in (0, 1, 2), f"{what}: exit {rc}: {cap.err}"
    assert "Traceback" not in cap.err, f"{what}: {cap.err}"
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith("paddle-fsdp-ckpt") and "error:" in lines[0], (what, cap.err)
        assert len(lines[0]) > len("paddle-fsdp-ckpt x: error: ") + 5, (what, cap.err)
    new = tree(work) - before
    if out is not None:
        outside = {p for p in new if not (p == out.name or p.startswith(out.name + os.sep))}
        assert not outside, f"{what}: files created outside {out}: {sorted(outside)[:5]}"
        assert not any(p.startswith(out.name + ".tmp-") for p in tree(work)), f"{what}: staging left behind"
        if rc != 0:
            assert not out.exists() or not any(out.iterdir()), f"{what}: failed run left {out} populated"
    else:
        assert not new, f"{what}: created {sorted(new)[:5]}"
    return rc, cap


# ------------------------------------------------------------------------------------------------ base inputs


def make_hf(directory: Path) -> None:
    rng = np.random.default_rng(1)
    directory.mkdir(parents=True)
    shards = (
        {"a.weight": rng.standard_normal((4, 6)).astype(np.float32), "b.bias": np.arange(5, dtype=np.int64)},
        {"c.weight": rng.standard_normal((3, 2)).astype(np.float16)},
    )
    weight_map = {}
    for i, t in enumerate(shards):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        stnp.save_file(t, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("toolsfuzz")
    make_hf(root / "hf")
    assert cli_main(["from-hf", str(root / "hf"), str(root / "ckpt")]) == 0
    return root


def fresh(base: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(base / name, dst)
    return dst


# ------------------------------------------------------------------------------------------------ mutations

JUNK_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    10**400,
    1.5,
    float("nan"),
    "x",
    "../../etc/passwd",
    "/etc/passwd",
    [],
    [1, 2],
    {},
    {"a": 1},
    "a" * 300,
]


def junk(rng: random.Random):
    return rng.choice(JUNK_VALUES)


def json_text(obj) -> str:
    return json.dumps(obj, allow_nan=True)


def mutate_json_obj(rng: random.Random, obj):
    """Replace a random node of a JSON-like object with junk, or drop / add a key."""
    if isinstance(obj, dict) and obj and rng.random() < 0.7:
        k = rng.choice(list(obj))
        r = rng.random()
        if r < 0.2:
            del obj[k]
        elif r < 0.6:
            obj[k] = mutate_json_obj(rng, obj[k])
        else:
            obj[k] = junk(rng)
        return obj
    if isinstance(obj, list) and obj and rng.random() < 0.7:
        i = rng.randrange(len(obj))
        obj[i] = mutate_json_obj(rng, obj[i])
        return obj
    return junk(rng)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    r = rng.random()
    if r < 0.3 and b:
        cut = rng.randrange(len(b))
        return bytes(b[:cut])
    if r < 0.7 and b:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    pos = rng.randrange(len(b) + 1)
    return bytes(b[:pos]) + os.urandom(rng.randint(1, 32)) + bytes(b[pos:])


def st_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def st_write(path: Path, header, data: bytes, header_len: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json_text(header).encode()
    n = len(text) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + text + data)


def mutate_st_header(rng: random.Random, path: Path) -> str:
    header, data = st_parts(path)
    names = [k for k in header if k != "__metadata__"]
    k = rng.choice(names)
    r = rng.randrange(12)
    if r == 0:
        st_write(path, header, data, header_len=rng.choice([2**63, 2**40, 10**12, 0, 1]))
        return "header length"
    if r == 1:
        st_write(path, b"{not json" + b" " * 20, data)
        return "non-JSON header"
    if r == 2:
        header[k]["data_offsets"] = [0, 10**15]
    elif r == 3:
        header[k]["data_offsets"] = [len(data) + 8, len(data) + 8 + 4 * int(np.prod(header[k]["shape"]))]
    elif r == 4:  # overlapping with another tensor of the file
        other = rng.choice(names)
        header[k]["data_offsets"] = header[other]["data_offsets"]
        header[k]["shape"] = header[other]["shape"]
        header[k]["dtype"] = header[other]["dtype"]
    elif r == 5:
        header[k]["dtype"] = rng.choice(["Q99", "", "F128", 7, None])
    elif r == 6:
        header[k]["shape"] = rng.choice([[2**40, 2**40], [2**62, 4], [-1, 4], [1.5], ["3"], [2**64]])
    elif r == 7:
        st_write(path, header, data[: rng.randrange(max(1, len(data)))])
        return "data shorter"
    elif r == 8:
        header[k]["shape"] = [25_000_000_000]  # 100 GB of float32, offsets claim it too
        header[k]["dtype"] = "F32"
        header[k]["data_offsets"] = [0, 100_000_000_000]
    elif r == 9:
        header = mutate_json_obj(rng, header)
    elif r == 10:
        header["__metadata__"] = junk(rng)
    else:
        header[k]["data_offsets"] = [8, 4]  # reversed
    st_write(path, header, data)
    return f"header mutation {r}"


def mutate_hf_dir(rng: random.Random, hf: Path, work: Path) -> str:
    shards = sorted(hf.glob("*.safetensors"))
    r = rng.randrange(10)
    if r < 3:
        return mutate_st_header(rng, rng.choice(shards))
    if r == 3:
        p = rng.choice(shards)
        p.write_bytes(mutate_bytes(rng, p.read_bytes()))
        return "shard bytes"
    index = json.loads((hf / INDEX).read_text())
    if r == 4:
        index = mutate_json_obj(rng, index)
    elif r == 5:
        k = rng.choice(list(index["weight_map"]))
        index["weight_map"][k] = rng.choice(
            ["../outside.safetensors", "/etc/passwd", "missing.safetensors", "sub/x.safetensors", "", ".", "fifo"]
        )
        if index["weight_map"][k] == "fifo":
            os.mkfifo(hf / "fifo")
        if index["weight_map"][k] == "../outside.safetensors":
            shutil.copy(shards[0], hf.parent / "outside.safetensors")
    elif r == 6:
        index["metadata"]["total_size"] = rng.choice([10**30, -5, "big", None, float("inf")])
    elif r == 7:  # a symlink out of the directory in place of a shard, or a FIFO / device
        p = rng.choice(shards)
        p.unlink()
        choice = rng.randrange(3)
        if choice == 0:
            shutil.copy(shards[0] if p != shards[0] else shards[1], work / "elsewhere.safetensors")
            p.symlink_to(work / "elsewhere.safetensors")
        elif choice == 1:
            os.mkfifo(p)
        else:
            p.symlink_to("/dev/zero")
    elif r == 8:
        (hf / INDEX).write_text("{" * 6000)
        return "deep index"
    else:
        (hf / INDEX).write_text(rng.choice(["", "null", "[]", '{"weight_map": []}', "\x00\xff", "NaN"]))
        return "index text"
    (hf / INDEX).write_text(json_text(index))
    return f"index mutation {r}"


# ------------------------------------------------------------------------------------------------ tests


def test_from_hf_fuzz(base, tmp_path, capsys):
    rng = random.Random(SEED)
    codes = {}
    for i in range(ROUNDS):
        work = tmp_path / f"r{i}"
        work.mkdir()
        shutil.copytree(base / "hf", work / "hf")
        what = mutate_hf_dir(rng, work / "hf", work)
        out = work / "out"
        rc, cap = run_cli(capsys, work, ["from-hf", work / "hf", out], out, f"seed {SEED} round {i}: {what}")
        codes[rc] = codes.get(rc, 0) + 1
        shutil.rmtree(work)
    assert codes.get(2, 0) > ROUNDS // 2, codes  # most mutations are refused, by name


def test_inspect_verify_of_a_crafted_hf_dir(base, tmp_path, capsys):
    rng = random.Random(SEED + 1)
    for i in range(ROUNDS // 2):
        work = tmp_path / f"r{i}"
        work.mkdir()
        shutil.copytree(base / "hf", work / "hf")
        what = mutate_hf_dir(rng, work / "hf", work)
        for cmd in ("inspect", "verify"):
            run_cli(capsys, work, [cmd, work / "hf"], None, f"seed {SEED + 1} round {i} {cmd}: {what}")
        out = work / "imp"
        run_cli(capsys, work, ["import-stock", work / "hf", out], out, f"seed {SEED + 1} round {i} import: {what}")
        shutil.rmtree(work)


def qwen3_config() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "tie_word_embeddings": False,
    }


CONFIG_FIELDS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"]


def make_qwen3_hf(directory: Path) -> None:
    """Every parameter the qwen3 preset expects for :func:`qwen3_config`, random, one shard + config.json."""
    from paddle.distributed.fsdp.tools.presets import expected_params, get_preset, model_dims

    rng = np.random.default_rng(2)
    directory.mkdir(parents=True)
    cfg = qwen3_config()
    params = expected_params(get_preset("qwen3"), model_dims(cfg))
    stnp.save_file(
        {n: rng.standard_normal(e.shape).astype(np.float32) for n, e in params.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3fuzz")
    make_qwen3_hf(root / "hf")
    assert cli_main(["from-hf", str(root / "hf"), str(root / "ckpt"), "--preset", "qwen3"]) == 0
    assert cli_main(["from-hf", str(root / "hf"), str(root / "fused"), "--preset", "qwen3-fused"]) == 0
    return root


def test_config_fuzz(qwen3, tmp_path, capsys):
    """Crafted config.json against a real qwen3 export / checkpoint (unfused and fused): refused by name or
    converted with every shape checked; never a crash, never a huge allocation."""
    rng = random.Random(SEED + 2)
    codes = {}
    for i in range(ROUNDS):
        work = tmp_path / f"r{i}"
        work.mkdir()
        cfg = qwen3_config()
        r = rng.randrange(5)
        if r == 0:
            cfg[rng.choice(CONFIG_FIELDS)] = rng.choice([-4, 0, 3, 7, 2**62, 10**30, "16", 1.5, float("nan"), None, []])
            text = json_text(cfg)
        elif r == 1:
            text = json_text(mutate_json_obj(rng, cfg))
        elif r == 2:
            cfg["num_attention_heads"] = rng.choice([3, 5, 6, 8, 1])  # heads not dividing hidden size / kv heads
            cfg["num_key_value_heads"] = rng.choice([1, 2, 4, 8])
            if rng.random() < 0.5:
                cfg.pop("head_dim")
            text = json_text(cfg)
        elif r == 3:
            cfg.update(
                rng.choice(
                    [
                        {"num_experts": 2**40, "moe_intermediate_size": 8},
                        {"num_hidden_layers": 10**7},
                        {"mlp_only_layers": [True, -1, 10**20]},
                        {"decoder_sparse_step": 0, "num_experts": 4},
                        {"vocab_size": 2**62},
                        {"tie_word_embeddings": "yes"},
                        {"model_type": "llama"},
                    ]
                )
            )
            text = json_text(cfg)
        else:
            text = rng.choice(["", "[]", "{" * 5000, '{"hidden_size": Infinity}', "\xff", '"x"'])
        (work / "config.json").write_text(text)
        preset = rng.choice(["qwen3", "qwen3-fused", "qwen3-moe", "llama"])
        what = f"seed {SEED + 2} round {i}: {preset} {text[:120]}"
        src = qwen3 / ("fused" if preset.endswith("-fused") else "ckpt")
        out = work / "hf_out"
        rc, _ = run_cli(
            capsys, work, ["to-hf", src, out, "--preset", preset, "--config", work / "config.json"], out, what
        )
        codes[rc] = codes.get(rc, 0) + 1
        out = work / "ck_out"
        rc, _ = run_cli(
            capsys,
            work,
            ["from-hf", qwen3 / "hf", out, "--preset", preset, "--config", work / "config.json"],
            out,
            what,
        )
        codes[rc] = codes.get(rc, 0) + 1
        shutil.rmtree(work)
    assert codes.get(0, 0) > 0 and codes.get(2, 0) > 0, codes  # some configs still fit, most are refused


RULES = {"rename": [["^a\\.", "A."]], "transpose": ["^a\\.weight$"]}


def test_rules_fuzz(base, tmp_path, capsys):
    rng = random.Random(SEED + 3)
    for i in range(ROUNDS):
        work = tmp_path / f"r{i}"
        work.mkdir()
        r = rng.randrange(4)
        if r == 0:
            text = json_text(mutate_json_obj(rng, json.loads(json.dumps(RULES))))
        elif r == 1:
            bad = rng.choice(["(", "[", "a{99999999999}", "(?P<x>", "\\", "(a)\\9", "*"])
            text = json_text({"rename": [[bad, "\\1"]], "transpose": [bad]})
        elif r == 2:
            text = json_text({"rename": [["^(.*)$", rng.choice(["\\5", "\\g<9>", "__metadata__", "", "../x"])]]})
        else:
            text = rng.choice(["", "[]", "{" * 5000, "\xff\xfe", '{"rename": NaN}', "null"])
        (work / "rules.json").write_text(text)
        what = f"seed {SEED + 3} round {i}: {text[:120]}"
        out = work / "o1"
        run_cli(capsys, work, ["to-hf", base / "ckpt", out, "--rules", work / "rules.json"], out, what)
        out = work / "o2"
        run_cli(capsys, work, ["from-hf", base / "hf", out, "--rules", work / "rules.json"], out, what)
        shutil.rmtree(work)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict as stock_save

    root = tmp_path_factory.mktemp("stockfuzz") / "stock"
    sd = {"w": paddle.arange(24, dtype="float32").reshape([4, 6]), "b": paddle.ones([5], dtype="float32")}
    stock_save(sd, str(root))
    return root


def mutate_pickle(rng: random.Random, data: bytes) -> bytes:
    r = rng.random()
    if r < 0.5:
        return mutate_bytes(rng, data)
    # swap an integer-looking byte run for a huge one: keeps the pickle parseable more often
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(b))
        if b[i] in (ord("K"), ord("J")):  # BININT1 / BININT: make the argument big or negative
            b[i] = ord("J")
            b[i + 1 : i + 5] = struct.pack("<i", rng.choice([-1, 2**31 - 1, -(2**31)]))
    return bytes(b)


def test_stock_fuzz(stock, tmp_path, capsys):
    rng = random.Random(SEED + 4)
    files = sorted(p.name for p in stock.iterdir())
    for i in range(ROUNDS):
        work = tmp_path / f"r{i}"
        work.mkdir()
        src = work / "stock"
        shutil.copytree(stock, src)
        name = rng.choice(files)
        p = src / name
        if name.endswith(".metadata"):
            p.write_bytes(mutate_pickle(rng, p.read_bytes()))
        elif rng.random() < 0.5:
            p.write_bytes(p.read_bytes()[: rng.randrange(max(1, p.stat().st_size))])
        elif rng.random() < 0.5:
            p.unlink()
            kind = rng.randrange(3)
            if kind == 0:
                os.mkfifo(p)
            elif kind == 1:
                p.symlink_to("/dev/zero")
            else:
                p.mkdir()
        else:
            p.write_bytes(mutate_bytes(rng, p.read_bytes()))
        what = f"seed {SEED + 4} round {i}: {name}"
        for cmd in ("inspect", "verify"):
            run_cli(capsys, work, [cmd, src], None, f"{what} {cmd}")
        out = work / "imp"
        run_cli(capsys, work, ["import-stock", src, out], out, f"{what} import-stock")
        shutil.rmtree(work)


def test_diff_with_one_side_crafted(base, stock, tmp_path, capsys):
    rng = random.Random(SEED + 5)
    for i in range(ROUNDS // 2):
        work = tmp_path / f"r{i}"
        work.mkdir()
        side = rng.choice(["hf", "ckpt"])
        shutil.copytree(base / side, work / "x")
        if side == "hf":
            what = mutate_hf_dir(rng, work / "x", work)
        else:
            files = sorted(p for p in (work / "x").rglob("*") if p.is_file())
            p = rng.choice(files)
            if p.suffix == ".json" and rng.random() < 0.6:
                try:
                    p.write_text(json_text(mutate_json_obj(rng, json.loads(p.read_text()))))
                except ValueError:
                    p.write_bytes(mutate_bytes(rng, p.read_bytes()))
            else:
                p.write_bytes(mutate_bytes(rng, p.read_bytes()))
            what = f"{p.name}"
        args = ["diff", base / "ckpt", work / "x"] if rng.random() < 0.5 else ["diff", work / "x", base / "ckpt"]
        run_cli(capsys, work, args, None, f"seed {SEED + 5} round {i}: {side} {what}")
        shutil.rmtree(work)


def _child_codes(commands: list[list[str]], limit: int = 3 << 30) -> list[int]:
    code = textwrap.dedent(
        f"""
        import resource
        from paddle.distributed.fsdp.tools.cli import main
        resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
        print("CODES", [main(a) for a in {commands!r}])
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr[-3000:]
    assert "CODES" in p.stdout, (p.stdout, p.stderr[-3000:])
    return json.loads(p.stdout.split("CODES", 1)[1].strip())


def _declare_100gb(shard: Path, data: bytes | None = None) -> None:
    header, old = st_parts(shard)
    k = next(n for n in header if n != "__metadata__")
    header = {k: {"dtype": "F32", "shape": [25_000_000_000], "data_offsets": [0, 100_000_000_000]}}
    st_write(shard, header, old if data is None else data)


def test_a_header_declaring_100gb_is_never_allocated(tmp_path):
    """A child limited to 3 GiB of address space: from-hf / inspect / verify / import-stock of a safetensors file
    whose header declares a 100 GB tensor its data does not hold: refused by name, nothing allocated."""
    make_hf(tmp_path / "hf")
    hf = tmp_path / "hf"
    (hf / INDEX).unlink()
    shard = sorted(hf.glob("*.safetensors"))[1]
    _declare_100gb(shard)
    out, imp = str(tmp_path / "out"), str(tmp_path / "imp")
    codes = _child_codes(
        [["from-hf", str(hf), out], ["inspect", str(hf)], ["verify", str(hf)], ["import-stock", str(hf), imp]]
    )
    assert codes == [2, 2, 1, 2], codes  # inspect refuses the header (offsets beyond the file); verify: unsound
    assert not os.path.exists(out) and not os.path.exists(imp)


def test_a_real_100gb_sparse_tensor_fails_by_name_under_a_memory_limit(tmp_path):
    """The data really is there (a sparse file): converting needs the whole tensor (documented: memory is the
    largest tensor), so under a 3 GiB limit it is a named out-of-memory error (exit 2), not an internal error."""
    make_hf(tmp_path / "hf")
    hf = tmp_path / "hf"
    (hf / INDEX).unlink()
    shard = sorted(hf.glob("*.safetensors"))[1]
    _declare_100gb(shard, b"")
    with open(shard, "r+b") as f:
        f.truncate(f.seek(0, 2) + 100_000_000_000)
    out, imp = str(tmp_path / "out"), str(tmp_path / "imp")
    codes = _child_codes([["from-hf", str(hf), out], ["inspect", str(hf)], ["import-stock", str(hf), imp]])
    assert codes == [2, 0, 2], codes
    assert not os.path.exists(out) and not os.path.exists(imp)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "dangling", "deep_array"])
def test_special_files_in_place_of_every_input(base, qwen3, stock, tmp_path, capsys, kind):
    """A FIFO, /dev/zero, a directory, a dangling symlink or 100k-deep JSON as the index, a shard, config.json,
    a rules file, a stock .metadata or .distcp file: a named refusal (or a problem from verify), never a hang."""

    def special(p: Path) -> None:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dev_zero":
            p.symlink_to("/dev/zero")
        elif kind == "directory":
            p.mkdir()
        elif kind == "dangling":
            p.symlink_to(tmp_path / "nowhere")
        else:
            p.write_text("[" * 100_000 + "]" * 100_000)

    cases = []
    hf = fresh(base, tmp_path, "hf")
    special(hf / INDEX)
    cases.append((["from-hf", hf], "out1"))
    hf2 = tmp_path / "hf2"
    shutil.copytree(base / "hf", hf2)
    special(sorted(hf2.glob("*.safetensors"))[0])
    cases.append((["from-hf", hf2], "out2"))
    cfg = tmp_path / "config.json"
    special(cfg)
    cases.append((["from-hf", qwen3 / "hf", "--preset", "qwen3", "--config", cfg], "out3"))
    cases.append((["to-hf", qwen3 / "ckpt", "--preset", "qwen3", "--config", cfg], "out4"))
    rules = tmp_path / "rules.json"
    special(rules)
    cases.append((["to-hf", base / "ckpt", "--rules", rules], "out5"))
    cases.append((["from-hf", base / "hf", "--rules", rules], "out6"))
    for name in sorted(p.name for p in stock.iterdir()):
        src = tmp_path / f"stock-{name}"
        shutil.copytree(stock, src)
        special(src / name)
        cases.append((["import-stock", src], f"imp-{name}"))
        for cmd in ("inspect", "verify"):
            run_cli(capsys, tmp_path, [cmd, src], None, f"{kind} {cmd} {name}")
    for args, out in cases:
        argv = [args[0], args[1], tmp_path / out, *args[2:]]
        rc, _ = run_cli(capsys, tmp_path, argv, tmp_path / out, f"{kind}: {argv}")
        assert rc == 2, (kind, argv)


@pytest.mark.parametrize("opcode", [b"\x96", b"\x8e", b"\x8d", b"\x95"])  # BYTEARRAY8, BINBYTES8, BINUNICODE8, FRAME
def test_a_pickle_declaring_a_huge_length_is_refused_before_allocating(stock, tmp_path, capsys, opcode):
    """A stock .metadata / .distcp pickle whose opcode declares 1 TiB: a named error, no MemoryError, no 1 TiB."""
    crafted = b"\x80\x05" + opcode + struct.pack("<Q", 1 << 40) + b"x" * 64 + b"."
    for name in sorted(p.name for p in stock.iterdir() if p.suffix in (".metadata", ".distcp")):
        src = tmp_path / f"s-{name}-{opcode.hex()}"
        shutil.copytree(stock, src)
        (src / name).write_bytes(crafted)
        for cmd in ("inspect", "verify"):
            run_cli(capsys, tmp_path, [cmd, src], None, f"{cmd} {name}")
        out = tmp_path / f"o-{name}-{opcode.hex()}"
        rc, cap = run_cli(capsys, tmp_path, ["import-stock", src, out], out, f"import-stock {name}")
        assert rc == 2 and "MemoryError" not in cap.err, cap.err


def test_many_input_files_under_a_small_open_file_limit(tmp_path):
    """300 safetensors shards (index and plain directory) under RLIMIT_NOFILE 200 (readers keep at most
    max_open_files = 64 each): from-hf, inspect, verify,
    import-stock and diff keep a bounded number of files open."""
    hf = tmp_path / "hf"
    hf.mkdir()
    weight_map = {}
    for i in range(300):
        name = f"model-{i:05d}-of-00300.safetensors"
        stnp.save_file({f"t{i}.weight": np.full((2, 3), i, np.float32)}, str(hf / name))
        weight_map[f"t{i}.weight"] = name
    plain = tmp_path / "plain"
    shutil.copytree(hf, plain)
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    code = textwrap.dedent(
        f"""
        import resource
        from paddle.distributed.fsdp.tools.cli import main
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
        print("CODES", [main(x) for x in (["from-hf", {str(hf)!r}, {a!r}], ["import-stock", {str(plain)!r}, {b!r}],
                                          ["inspect", {str(plain)!r}], ["verify", {str(plain)!r}], ["diff", {a!r}, {b!r}],
                                          ["to-hf", {a!r}, {c!r}, "--max-shard-size", "30"], ["verify", {a!r}])])
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "CODES" in p.stdout, p.stderr[-3000:]
    assert json.loads(p.stdout.split("CODES", 1)[1].strip()) == [0, 0, 0, 0, 0, 0, 0], p.stderr[-3000:]


@pytest.mark.parametrize("kind", ["link_to_empty_dir", "dangling_link", "fifo", "file", "non_empty_dir"])
def test_bad_output_paths_are_refused_before_any_work(base, tmp_path, capsys, kind):
    out = tmp_path / "out"
    (tmp_path / "elsewhere").mkdir()
    if kind == "link_to_empty_dir":
        out.symlink_to(tmp_path / "elsewhere")
    elif kind == "dangling_link":
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "file":
        out.write_text("x")
    else:
        out.mkdir()
        (out / "keep").write_text("x")
    for argv in (["from-hf", base / "hf", out], ["to-hf", base / "ckpt", out], ["import-stock", base / "hf", out]):
        before = tree(tmp_path)
        capsys.readouterr()
        rc = cli_main([str(a) for a in argv])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1 and str(out) in err[0], (argv, err)
        assert tree(tmp_path) == before, argv  # nothing written, nothing left, nothing through the link


def test_from_hf_preset_fuzz(qwen3, tmp_path, capsys):
    """Crafted headers and data of a real qwen3 export through the preset paths (renames, transposes, merges)."""
    rng = random.Random(SEED + 6)
    for i in range(ROUNDS // 2):
        work = tmp_path / f"r{i}"
        work.mkdir()
        shutil.copytree(qwen3 / "hf", work / "hf")
        shard = work / "hf" / "model.safetensors"
        what = mutate_st_header(rng, shard) if rng.random() < 0.7 else "bytes"
        if what == "bytes":
            shard.write_bytes(mutate_bytes(rng, shard.read_bytes()))
        preset = rng.choice(["qwen3", "qwen3-fused"])
        out = work / "out"
        run_cli(
            capsys, work, ["from-hf", work / "hf", out, "--preset", preset], out, f"seed {SEED + 6} round {i}: {what}"
        )
        shutil.rmtree(work)


@pytest.mark.parametrize(
    "extra",
    [
        ["--atol", "nan"],
        ["--rtol", "-1"],
        ["--atol", "inf"],
        ["--window", "0"],
        ["--window", "nan"],
        ["--window", "1e999"],
    ],
)
def test_bad_diff_options_are_usage_errors(base, capsys, extra):
    capsys.readouterr()
    rc = cli_main(["diff", str(base / "ckpt"), str(base / "ckpt"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("paddle-fsdp-ckpt diff"), err


@pytest.mark.parametrize("uid", ["-1", "x", "99999999999999999999999"])
def test_bad_unique_id_is_a_named_error(base, tmp_path, capsys, uid):
    capsys.readouterr()
    rc = cli_main(["import-stock", str(base / "hf"), str(tmp_path / "o"), "--unique-id", uid])
    err = capsys.readouterr().err
    assert rc == 2 and "internal error" not in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ field types


@pytest.fixture(scope="module")
def typed_inputs(qwen3, tmp_path_factory):
    """Exports (index with its paddle_fsdp record, an optimizer record added) by a preset and by rules."""
    root = tmp_path_factory.mktemp("typefuzz")
    cfg = qwen3 / "hf" / "config.json"
    rules = root / "rules.json"
    rules.write_text(json.dumps({"transpose": ["_proj\\.weight$"]}))
    out = {}
    for kind, how in (("preset", ["--preset", "qwen3"]), ("rules", ["--rules", str(rules)])):
        export = root / kind
        assert cli_main(["to-hf", str(qwen3 / "ckpt"), str(export), *how, "--config", str(cfg)]) == 0
        index = json.loads((export / INDEX).read_text())
        index["metadata"]["paddle_fsdp"]["optimizer"] = {"class": "AdamW", "global_state": {"learning_rate": 0.1}}
        (export / INDEX).write_text(json.dumps(index))
        assert cli_main(["from-hf", str(export), str(root / f"{kind}-back")]) == 0  # the baseline converts
        out[kind] = (export, index)
    return out


def _type_fuzz(capsys, tmp_path, doc, write, commands, label: str, read=lambda path: True) -> dict:
    """Every field of ``doc`` given every other JSON type (json_types.py); each command's contract (run_cli), and
    for a field the command reads (``read(path)``) a refusal by name: a wrong non-null type is never accepted."""
    from json_types import type_mutations

    codes: dict[int, int] = {}
    for i, (what, path, value, mutated) in enumerate(type_mutations(doc)):
        work = tmp_path / f"t{i}"
        work.mkdir()
        write(work, json.dumps(mutated))
        for args, out, *reads in commands(work):
            rc, cap = run_cli(capsys, work, args, out, f"{label}: {what}")
            codes[rc] = codes.get(rc, 0) + 1
            if value is not None and read(path) and reads != [False]:
                refused = (1, 2) if args[0] == "verify" else (2,)
                assert rc in refused, f"{label}: {what}: {args[0]} accepted a field of the wrong type (exit {rc})"
        shutil.rmtree(work)
    return codes


@pytest.mark.parametrize("kind", ["preset", "rules"])
def test_export_index_field_types(typed_inputs, tmp_path, capsys, kind):
    """Issue 29: ``"transposed": [["x"]]`` in the record made from-hf exit 3 (TypeError: unhashable type)."""
    export, index = typed_inputs[kind]

    def write(work: Path, text: str) -> None:
        shutil.copytree(export, work / "export")
        (work / "export" / INDEX).write_text(text)

    def commands(work: Path):
        yield ["from-hf", work / "export", work / "out"], work / "out"
        yield ["inspect", work / "export"], None, False  # inspect reads the safetensors files, not the index

    def read(path: tuple) -> bool:  # the optimizer's global state is opaque here (checked by the load, resume.py)
        return path[:4] != ("metadata", "paddle_fsdp", "optimizer", "global_state") or len(path) == 4

    codes = _type_fuzz(capsys, tmp_path, index, write, commands, "export index", read)
    assert codes.get(2, 0) > 0, codes


def test_config_field_types(qwen3, tmp_path, capsys):
    cfg = qwen3_config()
    cfg.update(mlp_only_layers=[], rope_scaling={"type": "linear", "factor": 1.0}, attention_bias=False)

    def write(work: Path, text: str) -> None:
        (work / "config.json").write_text(text)

    def commands(work: Path):
        c = work / "config.json"
        yield ["to-hf", qwen3 / "ckpt", work / "a", "--preset", "qwen3", "--config", c], work / "a"
        yield ["to-hf", qwen3 / "ckpt", work / "b", "--config", c], work / "b"  # the rules path, checked (3)
        yield ["from-hf", qwen3 / "hf", work / "c", "--preset", "qwen3-fused", "--config", c], work / "c"

    read = set(qwen3_config()) - {"architectures"} | {"mlp_only_layers", "attention_bias"}
    codes = _type_fuzz(capsys, tmp_path, cfg, write, commands, "config.json", lambda p: not p or p[0] in read)
    assert codes.get(0, 0) > 0 and codes.get(2, 0) > 0, codes


def test_rules_field_types(base, tmp_path, capsys):
    def write(work: Path, text: str) -> None:
        (work / "rules.json").write_text(text)

    def commands(work: Path):
        yield ["to-hf", base / "ckpt", work / "o1", "--rules", work / "rules.json"], work / "o1"
        yield ["from-hf", base / "hf", work / "o2", "--rules", work / "rules.json"], work / "o2"

    codes = _type_fuzz(capsys, tmp_path, RULES, write, commands, "rules")
    assert codes.get(2, 0) > 0, codes


def test_checkpoint_metadata_field_types(qwen3, tmp_path, capsys):
    """metadata.json (re-sealed into COMMIT, so each edit reaches the parser) and COMMIT of a real checkpoint,
    through every tool that reads a checkpoint."""
    from crafted import reseal

    md = json.loads((qwen3 / "ckpt" / "metadata.json").read_text())
    commit = json.loads((qwen3 / "ckpt" / "COMMIT").read_text())

    def write_md(work: Path, text: str) -> None:
        shutil.copytree(qwen3 / "ckpt", work / "ck")
        reseal(work / "ck", text.encode())

    def write_commit(work: Path, text: str) -> None:
        shutil.copytree(qwen3 / "ckpt", work / "ck")
        (work / "ck" / "COMMIT").write_text(text)

    def commands(work: Path):
        yield ["inspect", work / "ck"], None
        yield ["verify", work / "ck"], None
        yield ["to-hf", work / "ck", work / "o"], work / "o"

    read = lambda p: not p or p[0] != "values"  # noqa: E731 - the values are the caller's JSON, any type
    codes = _type_fuzz(capsys, tmp_path, md, write_md, commands, "metadata.json", read)
    codes2 = _type_fuzz(capsys, tmp_path, commit, write_commit, commands, "COMMIT")
    assert codes.get(2, 0) > 0 and codes2.get(2, 0) > 0, (codes, codes2)
