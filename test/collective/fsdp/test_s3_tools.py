"""``paddle-fsdp-ckpt from-hf`` reading Hugging Face safetensors from a real S3 server (SeaweedFS, started by the
fixtures on 127.0.0.1): the checkpoint equals the one converted from the same files on a local disk, headers are
parsed from ranged reads and every tensor byte is fetched once, and bad inputs on S3 are named (exit code 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stnp
from paddle.distributed.fsdp.checkpoint import load_full_state_dict, verify_checkpoint
from paddle.distributed.fsdp.tools.cli import main as cli_main

MIB = 1 << 20
RULES = {"rename": [[r"^model\.", "m."]], "transpose": [r"\.proj\.weight$"]}


def _hf_dir(directory: Path) -> dict[str, np.ndarray]:
    """Two shard files and an index: several dtypes, a transposed 2-D weight, one tensor above 8 MiB (its read is
    split into parallel ranged GETs)."""
    rng = np.random.default_rng(7)
    tensors = {
        "model.embed.weight": rng.standard_normal((1100, 2048)).astype(np.float32),  # 8.6 MiB
        "model.layers.0.proj.weight": rng.standard_normal((96, 64)).astype(np.float32),
        "model.layers.0.norm.weight": rng.standard_normal(64).astype(np.float16),
        "model.layers.1.proj.weight": rng.standard_normal((96, 64)).astype(np.float32),
        "model.steps": np.arange(5, dtype=np.int64),
    }
    directory.mkdir()
    names = sorted(tensors)
    shards = {"w-0.safetensors": names[:2], "w-1.safetensors": names[2:]}
    weight_map = {}
    for fname, keys in shards.items():
        stnp.save_file({k: tensors[k] for k in keys}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def _upload(s3storage, directory: Path, url: str) -> int:
    """Every file of ``directory`` as a plain object under ``url`` (as a user's copy of a model is); its bytes."""
    storage = s3storage.default_storage()
    objs, prefix = storage._split(url)
    total = 0
    for f in sorted(directory.iterdir()):
        objs.upload(f"{prefix}/{f.name}", [f.read_bytes()])
        total += f.stat().st_size
    return total


def _fetched(s3storage) -> int:
    return sum(o.bytes_read for o in s3storage.default_storage()._buckets.values())


def _same_checkpoints(a: str, b: str) -> None:
    fa, fb = load_full_state_dict(a), load_full_state_dict(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and np.array_equal(fa[k].numpy(), fb[k].numpy()), k


def test_from_hf_reads_s3_like_a_local_directory(tmp_path, s3_bucket, s3_env):
    tensors = _hf_dir(tmp_path / "hf")
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps(RULES))
    url = f"s3://{s3_bucket}/models/tiny"
    size = _upload(s3_env, tmp_path / "hf", url)
    assert cli_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "local"), "--rules", str(rules)]) == 0
    before = _fetched(s3_env)
    assert cli_main(["from-hf", url, str(tmp_path / "from_s3"), "--rules", str(rules)]) == 0
    # ranged reads: each header (its 8-byte length, then its JSON) and each tensor once, the index whole: exactly
    # the files' bytes, nothing downloaded twice
    assert _fetched(s3_env) - before == size
    _same_checkpoints(str(tmp_path / "local"), str(tmp_path / "from_s3"))
    assert verify_checkpoint(str(tmp_path / "from_s3")) == []
    full = load_full_state_dict(str(tmp_path / "from_s3"))
    for name, value in tensors.items():
        got = full[name.replace("model.", "m.", 1)].numpy()
        assert np.array_equal(got, value.T if name.endswith("proj.weight") else value), name
    # one file by its URL, and S3 to S3 (the output published atomically under its own URL)
    one = f"{url}/w-1.safetensors"
    assert cli_main(["from-hf", one, str(tmp_path / "one"), "--rules", str(rules)]) == 0
    assert cli_main(["from-hf", str(tmp_path / "hf" / "w-1.safetensors"), str(tmp_path / "one_local"),
                     "--rules", str(rules)]) == 0  # fmt: skip
    _same_checkpoints(str(tmp_path / "one_local"), str(tmp_path / "one"))
    out = f"s3://{s3_bucket}/ckpts/from-hf"
    assert cli_main(["from-hf", url, out, "--rules", str(rules)]) == 0
    assert verify_checkpoint(out) == []
    _same_checkpoints(str(tmp_path / "local"), out)


def test_bad_hf_inputs_on_s3_are_named(tmp_path, s3_bucket, s3_env, capsys):
    _hf_dir(tmp_path / "hf")
    url = f"s3://{s3_bucket}/models/cut"
    truncated = tmp_path / "cut"
    truncated.mkdir()
    for f in (tmp_path / "hf").iterdir():  # w-0 (the large tensor) loses its last 100 bytes
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[:-100] if f.name == "w-0.safetensors" else data)
    _upload(s3_env, truncated, url)
    cases = {
        f"s3://{s3_bucket}/models/none": "no such file or directory",
        url: "w-0.safetensors",  # its header says more bytes than the object has
        f"{url}/model.safetensors.index.json": "not a .safetensors file",
    }
    for i, (src, expect) in enumerate(cases.items()):
        assert cli_main(["from-hf", src, str(tmp_path / f"out{i}")]) == 2, src
        err = capsys.readouterr().err
        assert expect in err, (src, err)
        assert not os.path.exists(tmp_path / f"out{i}")
    from paddle.distributed.fsdp.tools.hf_format import read_config

    s3 = s3_env.default_storage()
    objs, prefix = s3._split(url)
    objs.upload(f"{prefix}/config.json", [b'{"model_type": "llama", "hidden_size": 64}'])
    raw, cfg = read_config(f"{url}/config.json")
    assert cfg["hidden_size"] == 64 and raw.startswith(b"{")
    objs.upload(f"{prefix}/big.json", [b" " * (17 * MIB)])
    with pytest.raises(Exception, match="big.json"):
        read_config(f"{url}/big.json")
