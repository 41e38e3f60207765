"""Stock use cases, observed the same way with and without the fork (run by test_stock_differential.py).

Usage: stock_differential.py GROUP WORKDIR OUT_JSON  (GROUP: "one" for one process, "two" under a 2-rank launch).
The process runs stock paddle when PADDLE_FSDP_FORK_DISABLE=1, the fork otherwise; the test runs it both ways
and compares the observations case by case. Each case returns a dict of observations:

* tensors as ``dtype[shape]:sha1`` of their bytes (bit-exact comparison, bf16 included);
* ``raise:<ExceptionType>`` for a call that raised (the type must match; messages may differ);
* plain values (return values, file names stock writes, values read back by stock's own reader).

Every stock multi-rank load moves tensors with ``.cuda()`` (stock's resharder); on a CPU build that fails. The
worker makes ``Tensor.cuda()`` a counting no-op (the conformance shim) so stock's results exist to compare
with, and reports ``cuda_calls`` per case outside the compared observations: where stock needed the shim, stock
fails on a plain CPU build, and the fork must not call ``.cuda()`` at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import traceback

import _paths  # noqa: F401
import numpy as np
import paddle
import paddle.distributed as dist

FORK = os.environ.get("PADDLE_FSDP_FORK_DISABLE") != "1"
CUDA_CALLS = [0]


def _counting_cuda(self, *args, **kwargs):
    CUDA_CALLS[0] += 1
    return self


paddle.Tensor.cuda = _counting_cuda
logging.getLogger().setLevel(logging.ERROR)


def stock_reader():
    """Stock's own loader in both modes (the overlay only redirects ``paddle.distributed.load_state_dict``); its
    ``.cuda()`` calls are not counted (they are stock's, not the fork's)."""
    from paddle.distributed.flex_checkpoint.dcp.load_state_dict import load_state_dict

    def read(*args, **kwargs):
        before = CUDA_CALLS[0]
        try:
            return load_state_dict(*args, **kwargs)
        finally:
            CUDA_CALLS[0] = before

    return read


# ------------------------------------------------------------------------------------------------ observing


def reset_stock_state() -> None:
    """Stock's loader keeps module-level state: metadata a failed load leaves behind (the next load in the process
    then fails too) and a per-path cache of file names (a later load of another ``unique_id`` of that path reads
    the cached version). Cleared before every call so each observation depends on its own arguments only."""
    from paddle.distributed.flex_checkpoint.dcp import load_state_dict as stock_module

    stock_module._metadata_manager.clear()
    stock_module.PATH_TO_CHECKPOINT_FILES.clear()


def digest(t) -> str:
    if t is None:
        return "None"
    if not isinstance(t, paddle.Tensor):
        return repr(t)
    if hasattr(t, "is_dist") and t.is_dist():
        t = t._local_value()
    dt = str(t.dtype).split(".")[-1]
    a = t.view("uint16").numpy() if t.dtype == paddle.bfloat16 else t.numpy()
    return f"{dt}{list(t.shape)}:{hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]}"


def digests(sd, prefix="") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(digests(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = digest(v)
    return out


def attempt(fn, *args, **kwargs):
    """The call's return value (repr) or ``raise:<type>/<its bases>``."""
    reset_stock_state()
    try:
        r = fn(*args, **kwargs)
    except Exception as e:
        if os.environ.get("STOCK_DIFF_DEBUG"):
            traceback.print_exc()
        reset_stock_state()
        return "raise:" + "/".join(c.__name__ for c in type(e).__mro__ if c not in (BaseException, Exception, object))
    return repr(r) if r is None or isinstance(r, (int, float, str, bool)) else f"<{type(r).__name__}>"


def stock_files(d) -> list[str]:
    """The names of stock's format in ``d`` (the fork may add its own files beside them)."""
    try:
        names = os.listdir(d)
    except OSError as e:
        return [f"oserror:{type(e).__name__}"]
    return sorted(
        n for n in names if n.endswith((".metadata", ".distcp")) and not n.endswith("auto_generated.metadata")
    )


def zeros_like(sd):
    return {k: zeros_like(v) if isinstance(v, dict) else paddle.zeros_like(v) for k, v in sd.items()}


def arr(shape, seed, dtype="float32"):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def t(shape, seed=0, dtype="float32"):
    if dtype == "bfloat16":
        return paddle.to_tensor(arr(shape, seed)).astype("bfloat16")
    if dtype == "bool":
        return paddle.to_tensor(arr(shape, seed) > 0)
    if dtype.startswith(("int", "uint")):
        return paddle.to_tensor((arr(shape, seed) * 50).astype(dtype))
    return paddle.to_tensor(arr(shape, seed, dtype))


def roundtrip(d, sd, save_kw=None, load_kw=None, target=None, stock_reads=True):
    """save ``sd`` to ``d``, load into ``target`` (zeros like ``sd``) with the redirected API and with stock's
    own reader; every outcome observed. ``stock_reads``: stock 3.3.1 can read these files with these arguments
    (so its reader must return the saved values)."""
    save_kw, load_kw = save_kw or {}, load_kw or {}
    o = {"save": attempt(dist.save_state_dict, sd, d, **save_kw), "files": stock_files(d)}
    o["expect_loaded"] = digests(sd) if target is None else None
    if stock_reads:
        o["expect_stock_read"] = o["expect_loaded"]
    got = zeros_like(sd) if target is None else target
    o["load"] = attempt(dist.load_state_dict, got, d, **load_kw)
    o["loaded"] = digests(got)
    ref = zeros_like(sd) if target is None else zeros_like(target)
    o["stock_reads"] = attempt(stock_reader(), ref, d, **load_kw)
    o["stock_read"] = digests(ref)
    return o


# ------------------------------------------------------------------------------------------------ one process


def model_and_optimizer(seed=0, scheduler=False):
    paddle.seed(seed)
    m = paddle.nn.Sequential(paddle.nn.Linear(4, 6), paddle.nn.LayerNorm(6), paddle.nn.Linear(6, 3))
    lr = paddle.optimizer.lr.StepDecay(0.01, step_size=2) if scheduler else 0.01
    opt = paddle.optimizer.AdamW(learning_rate=lr, parameters=m.parameters())
    loss = m(paddle.to_tensor(arr((5, 4), seed))).sum()
    loss.backward()
    opt.step()
    opt.clear_grad()
    return m, opt


def case_model_optimizer(d):
    """A trainer's checkpoint: model and optimizer state in one flat dict, resumed into live objects."""
    m, opt = model_and_optimizer(1)
    sd = {**m.state_dict(), **opt.state_dict()}
    o = {"keys": sorted(digests(sd))}
    o.update(roundtrip(d, sd))
    m2, opt2 = model_and_optimizer(2)
    # the model's keys are stable; a second optimizer in one process gets other parameter names (linear_3...)
    o["load_into_live"] = attempt(dist.load_state_dict, m2.state_dict(), d)
    o["load_renamed_optimizer"] = attempt(dist.load_state_dict, opt2.state_dict(), d)
    o["live_params"] = [digest(p) for p in m2.parameters()]
    o["live_flags"] = [(p.stop_gradient, p.persistable, str(p.dtype)) for p in m2.parameters()]
    o["expect_live_params"] = [digest(p) for p in m.parameters()]
    return o


def case_model_optimizer_nested(d):
    """The same as {"model": ..., "opt": ...} (stock 3.3.1 cannot load nested dicts: ValueError / KeyError)."""
    m, opt = model_and_optimizer(1)
    return roundtrip(d, {"model": m.state_dict(), "opt": opt.state_dict()}, stock_reads=False)


def case_model_flat_keys(d):
    m, _ = model_and_optimizer(3)
    return roundtrip(d, m.state_dict())


def case_optimizer_with_scheduler(d):
    m, opt = model_and_optimizer(4, scheduler=True)
    sd = {"model": m.state_dict(), "opt": opt.state_dict()}
    return {"save": attempt(dist.save_state_dict, sd, d)}


def case_nested(d):
    sd = {"a": {"b": {"c": t([3], 1)}, "d": t([2, 2], 2)}, "e": t([1], 3)}
    return roundtrip(d, sd, stock_reads=False)


def case_non_tensor_values(d):
    o = {}
    for i, v in enumerate([3, 2.5, "s", None, [1, 2], (1,), np.ones(2)]):
        o[f"save{i}"] = attempt(dist.save_state_dict, {"w": t([2], i), "x": v}, os.path.join(d, str(i)))
    return o


def case_not_a_dict(d):
    return {
        "save_list": attempt(dist.save_state_dict, [t([2])], os.path.join(d, "a")),
        "save_tensor": attempt(dist.save_state_dict, t([2]), os.path.join(d, "b")),
    }


def case_empty(d):
    o = {"save": attempt(dist.save_state_dict, {}, d), "files": stock_files(d)}
    o["load_empty"] = attempt(dist.load_state_dict, {}, d)
    got = {"w": paddle.full([2], 3.0)}
    o["load_key"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = o["expect_loaded"] = digest(got["w"])
    return o


def case_dtypes(d):
    sd = {
        dt: t([3, 2], i, dt)
        for i, dt in enumerate(
            ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
        )
    }
    return roundtrip(d, sd)


def case_complex(d):
    sd = {"c": paddle.to_tensor(arr((3,), 1) + 1j * arr((3,), 2)).astype("complex64")}
    return roundtrip(d, sd)


def case_zero_d_and_empty(d):
    sd = {"s": paddle.to_tensor(3.5), "i": paddle.to_tensor(7, dtype="int64"), "z": paddle.zeros([0, 3])}
    return roundtrip(d, sd)


def case_odd_keys(d):
    sd = {"a.b": t([2], 1), "x/y": t([2], 2), "ü ñ": t([2], 3), "with space": t([2], 4), "": t([1], 5)}
    return roundtrip(d, sd)


def case_path_is_file(d):
    os.makedirs(d)
    f = os.path.join(d, "f")
    with open(f, "w") as fh:
        fh.write("x")
    return {
        "save": attempt(dist.save_state_dict, {"w": t([2])}, f),
        "load": attempt(dist.load_state_dict, {"w": paddle.zeros([2])}, f),
        "load_missing_dir": attempt(dist.load_state_dict, {"w": paddle.zeros([2])}, os.path.join(d, "nope")),
    }


def case_mismatches(d):
    dist.save_state_dict({"w": t([3, 2], 1), "b": t([2], 2)}, d)
    o = {}
    got = {"w": paddle.zeros([3, 2]), "b": paddle.zeros([2]), "extra": paddle.full([2], 7.0)}
    o["expect_extra_loaded"] = digests(got)  # a key the checkpoint lacks fails the load (stock: KeyError)
    o["target_has_extra_key"] = attempt(dist.load_state_dict, got, d)
    o["extra_loaded"] = digests(got)
    got = {"w": paddle.zeros([3, 2])}
    o["checkpoint_has_extra_key"] = attempt(dist.load_state_dict, got, d)
    o["subset_loaded"] = digests(got)
    got = {"w": paddle.zeros([2, 3]), "b": paddle.zeros([2])}
    o["shape"] = attempt(dist.load_state_dict, got, d)
    got = {"w": paddle.zeros([3, 2], dtype="float64"), "b": paddle.zeros([2])}
    o["dtype"] = attempt(dist.load_state_dict, got, d)
    got = {"w": paddle.zeros([3, 2], dtype="bfloat16"), "b": paddle.zeros([2])}
    o["dtype_bf16"] = attempt(dist.load_state_dict, got, d)
    got = {"w": paddle.zeros([6]), "b": paddle.zeros([2])}
    o["same_numel_other_shape"] = attempt(dist.load_state_dict, got, d)
    return o


def case_unique_ids(d):
    o = {}
    for uid in (0, 1):
        o[f"save{uid}"] = attempt(dist.save_state_dict, {"w": t([4], 10 + uid)}, d, unique_id=uid)
    o["files"] = stock_files(d)
    for uid in (None, 0, 1, 2):
        got = {"w": paddle.zeros([4])}
        o[f"load{uid}"] = attempt(dist.load_state_dict, got, d, unique_id=uid)
        o[f"loaded{uid}"] = digest(got["w"])
        o[f"expect_loaded{uid}"] = digest(t([4], 10 + (0 if uid == 0 else 1)) if uid != 2 else got["w"])
    o["negative"] = attempt(dist.save_state_dict, {"w": t([4])}, d, unique_id=-1)
    return o


def case_save_twice_same_path(d):
    o = {}
    for seed in (1, 2):
        o[f"save{seed}"] = attempt(dist.save_state_dict, {"w": t([4], seed)}, d)
    o["files"] = stock_files(d)
    got = {"w": paddle.zeros([4])}
    o["load"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = digest(got["w"])
    return o


def case_save_twice_other_keys(d):
    """Stock's second save into a path keeps the first save's metadata (write_to_file_if_empty): broken in both."""
    o = {"save1": attempt(dist.save_state_dict, {"w": t([4], 1), "old": t([2], 1)}, d)}
    o["save2"] = attempt(dist.save_state_dict, {"w": t([4], 2)}, d)
    o["files"] = stock_files(d)
    got = {"w": paddle.zeros([4]), "old": paddle.zeros([2])}
    o["expect_loaded"] = digests(got)  # a failed load changes nothing (stock's writes "w" before it fails)
    o["load"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = digests(got)
    return o


def case_safetensors_true(d):
    sd = {"w": t([3, 4], 1), "h": t([5], 2, "bfloat16"), "i": t([2], 3, "int64")}
    o = roundtrip(os.path.join(d, "a"), sd, {"safetensors": True}, {"safetensors": True})
    o.pop("files")  # the fork writes its own format here (safetensors=True goes to the engine)
    for k, v in roundtrip(os.path.join(d, "b"), sd, {"safetensors": True}, {}, stock_reads=False).items():
        if k != "files":
            o[f"expect_default_load_{k[7:]}" if k.startswith("expect_") else f"default_load_{k}"] = v
    return o


def case_safetensors_false_explicit(d):
    return roundtrip(d, {"w": t([3], 1)}, {"safetensors": False}, {"safetensors": False})


def case_format_flags_crossed(d):
    """Stock's pickles read with safetensors=True; the safetensors variant read with unique_id=0."""
    o = {}
    for k, v in roundtrip(os.path.join(d, "a"), {"w": t([3], 1)}, {}, {"safetensors": True}, stock_reads=False).items():
        o[f"pickles_{k}"] = v
    for k, v in roundtrip(
        os.path.join(d, "b"), {"w": t([3], 2)}, {"safetensors": True}, {"unique_id": 0}, stock_reads=False
    ).items():
        o[f"st_{k}"] = v
    return {("expect_" + k.replace("expect_", "")) if "expect_" in k else k: v for k, v in o.items()}


def case_offload_and_keywords(d):
    sd = {"w": t([3, 4], 1), "b": t([4], 2)}
    o = roundtrip(d, sd, {"process_group": None, "coordinator_rank": 0, "async_save": False}, {"offload": True})
    for kw in ({"mw_name_compatibility": False}, {"comm_method": "send_recv"}, {"coordinator_rank": 0}):
        got = zeros_like(sd)
        name = next(iter(kw))
        o[f"load_{name}"] = attempt(dist.load_state_dict, got, d, **kw)
        o[f"loaded_{name}"] = digests(got)
    o["bad_comm_method"] = attempt(dist.load_state_dict, zeros_like(sd), d, comm_method="bogus")
    return o


def case_positional(d):
    sd = {"w": t([3], 1)}
    o = {"save": attempt(dist.save_state_dict, sd, d, None, 0, None, False, False, False)}
    got = {"w": paddle.zeros([3])}
    o["load"] = attempt(dist.load_state_dict, got, d, None, 0, None, False, True, None, False, None, "broadcast")
    o["loaded"] = digest(got["w"])
    return o


def case_structure_change(d):
    o = {"save_nested": attempt(dist.save_state_dict, {"a": {"b": t([3], 1)}, "c": t([2], 2)}, d)}
    flat = {"a.b": paddle.zeros([3]), "c": paddle.zeros([2])}
    o["load_flat"] = attempt(dist.load_state_dict, flat, d)
    o["flat"] = digests(flat)
    nested = {"a": {"b": paddle.zeros([3])}, "c": paddle.zeros([2])}
    o["load_nested"] = attempt(dist.load_state_dict, nested, d)
    o["nested"] = digests(nested)
    o["expect_flat"] = {"a.b": digest(t([3], 1)), "c": digest(t([2], 2))}
    o["expect_nested"] = {"a/b": digest(t([3], 1)), "c": digest(t([2], 2))}
    d2 = d + "_flat"
    o["save_flat"] = attempt(dist.save_state_dict, {"a.b": t([3], 3)}, d2)
    nested = {"a": {"b": paddle.zeros([3])}}
    o["load_nested_from_flat"] = attempt(dist.load_state_dict, nested, d2)
    o["nested_from_flat"] = digests(nested)
    o["expect_nested_from_flat"] = {"a/b": digest(t([3], 3))}
    return o


def case_merge_sharded(d):
    from paddle.distributed.flex_checkpoint.dcp.load_state_dict import merge_sharded_state_dict
    from safetensors.numpy import load_file

    sd = {"model": {"w": t([4, 2], 1), "b": t([2], 2)}}
    o = {"save": attempt(dist.save_state_dict, sd, os.path.join(d, "ck"))}
    o["merge"] = attempt(merge_sharded_state_dict, os.path.join(d, "ck"), os.path.join(d, "merged"))
    try:
        merged = {}
        for n in sorted(os.listdir(os.path.join(d, "merged"))):
            if n.endswith(".safetensors"):
                merged.update(
                    {
                        k: hashlib.sha1(v.tobytes()).hexdigest()[:16]
                        for k, v in load_file(os.path.join(d, "merged", n)).items()
                    }
                )
        o["merged"] = merged
    except OSError as e:
        o["merged"] = f"oserror:{type(e).__name__}"
    return o


def case_paddle_load_of_files(d):
    sd = {"w": t([3, 2], 1), "n": {"b": t([2], 2)}}
    o = {"save": attempt(dist.save_state_dict, sd, d)}
    for n in stock_files(d):
        if n.endswith(".distcp"):
            try:
                o[n] = digests(paddle.load(os.path.join(d, n)))
            except Exception as e:
                o[n] = f"raise:{type(e).__name__}"
        else:
            try:
                md = paddle.load(os.path.join(d, n))
                o[n] = sorted(md.state_dict_metadata)
                o[n + ":flat_mapping"] = sorted(md.flat_mapping.items())
            except Exception as e:
                o[n] = f"raise:{type(e).__name__}"
    return o


def case_sharded_weight_boxes(d):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    full = arr((6, 4), 1)
    sd = {
        "top": ShardedWeight("top", paddle.to_tensor(full[:3]), (3, 4), (6, 4), (0, 0)),
        "bottom": ShardedWeight("bottom", paddle.to_tensor(full[3:]), (3, 4), (6, 4), (3, 0)),
    }
    o = {"save": attempt(dist.save_state_dict, {"w": paddle.to_tensor(full)}, d), "files": stock_files(d)}
    for name, sw in sd.items():
        target = ShardedWeight("w", paddle.zeros(sw.local_shape), sw.local_shape, (6, 4), sw.global_offset)
        o[f"load_{name}"] = attempt(dist.load_state_dict, {"w": target}, d)
        o[f"loaded_{name}"] = digest(target.local_tensor)
        o[f"expect_loaded_{name}"] = digest(sw.local_tensor)
    return o


def case_async_save(d):
    sd = {"w": t([3, 2], 1)}
    o = {"save": attempt(dist.save_state_dict, sd, d, async_save=True)}
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import clear_async_save_task_queue

    clear_async_save_task_queue()
    o["files"] = stock_files(d)
    o["expect_files"] = ["0.metadata", "0_0.distcp"]
    got = {"w": paddle.zeros([3, 2])}
    o["load"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = digest(got["w"])
    o["expect_loaded"] = digest(sd["w"])
    return o


def case_save_replicas_and_safetensors_versions(d):
    sd = {"w": t([3, 2], 1)}
    o = roundtrip(os.path.join(d, "rep"), sd, {"save_replicas": True})
    for uid in (3, 4):
        o[f"save_st{uid}"] = attempt(
            dist.save_state_dict, {"w": t([3, 2], uid)}, os.path.join(d, "st"), unique_id=uid, safetensors=True
        )
    for uid in (3, 4):
        got = {"w": paddle.zeros([3, 2])}
        o[f"load_st{uid}"] = attempt(dist.load_state_dict, got, os.path.join(d, "st"), unique_id=uid, safetensors=True)
        o[f"loaded_st{uid}"] = digest(got["w"])
        o[f"expect_loaded_st{uid}"] = digest(t([3, 2], uid))
    return o


def case_master_weight_names(d):
    o = {"save": attempt(dist.save_state_dict, {"opt": {"master_weights": {"w": t([3], 1)}}}, d)}
    got = {"opt.w_fp32_master_0": paddle.zeros([3])}
    o["load_compat"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = digests(got)
    o["expect_loaded"] = {"opt.w_fp32_master_0": digest(t([3], 1))}
    got = {"opt.w_fp32_master_0": paddle.zeros([3])}
    o["load_no_compat"] = attempt(dist.load_state_dict, got, d, mw_name_compatibility=False)
    o["loaded_no_compat"] = o["expect_loaded_no_compat"] = digests(got)
    return o


def case_aoa(d):
    sd = {"a": t([4, 6], 1), "b": t([6], 2), "q": t([2, 3], 3), "k": t([2, 3], 4)}
    o = {"save": attempt(dist.save_state_dict, sd, d)}
    got = {"x": paddle.zeros([6, 4]), "b": paddle.zeros([6], dtype="float16"), "qk": paddle.zeros([2, 6])}
    aoa = {"aoa_statements": ["a^T -> x", 'b -> b, dtype="float16"', "q, k -> qk, axis=1"]}
    o["load"] = attempt(dist.load_state_dict, got, d, aoa_config=aoa)
    o["loaded"] = digests(got)
    o["expect_loaded"] = {
        "x": digest(paddle.to_tensor(sd["a"].numpy().T.copy())),
        "b": digest(sd["b"].astype("float16")),
        "qk": digest(paddle.concat([sd["q"], sd["k"]], axis=1)),
    }
    return o


def case_path_forms(d):
    """pathlib.Path, a trailing slash, a relative path, a directory holding a trainer's other files."""
    import pathlib

    o = {}
    sd = {"w": t([3], 1)}
    for name, path in {
        "pathlib": pathlib.Path(d) / "p",
        "slash": os.path.join(d, "s") + "/",
        "relative": os.path.relpath(os.path.join(d, "r")),
    }.items():
        o[f"save_{name}"] = attempt(dist.save_state_dict, sd, path)
        got = {"w": paddle.zeros([3])}
        o[f"load_{name}"] = attempt(dist.load_state_dict, got, path)
        o[f"loaded_{name}"] = digest(got["w"])
    busy = os.path.join(d, "busy")
    os.makedirs(os.path.join(busy, "logs"))
    with open(os.path.join(busy, "config.json"), "w") as f:
        f.write("{}")
    o["save_busy"] = attempt(dist.save_state_dict, sd, busy)
    o["busy_entries"] = sorted(os.listdir(busy))
    got = {"w": paddle.zeros([3])}
    o["load_busy"] = attempt(dist.load_state_dict, got, busy)
    o["loaded_busy"] = digest(got["w"])
    return o


def case_odd_values(d):
    return {
        "int_key": attempt(dist.save_state_dict, {0: t([2])}, os.path.join(d, "a")),
        "list_of_tensors": attempt(dist.save_state_dict, {"l": [t([2]), t([2])]}, os.path.join(d, "b")),
        "load_int_key": attempt(dist.load_state_dict, {0: paddle.zeros([2])}, os.path.join(d, "a")),
    }


def case_hf_directory(d):
    from safetensors.numpy import save_file

    os.makedirs(d)
    save_file({"x": arr((2, 3), 1)}, os.path.join(d, "model-00001-of-00002.safetensors"))
    save_file({"y": arr((4,), 2).astype("float16")}, os.path.join(d, "model-00002-of-00002.safetensors"))
    # first without the flag: stock's load with safetensors=True writes an .auto_generated.metadata file there
    o = {"without_flag": attempt(dist.load_state_dict, {"x": paddle.zeros([2, 3])}, d)}
    got = {"x": paddle.zeros([2, 3]), "y": paddle.zeros([4], dtype="float16")}
    o["load"] = attempt(dist.load_state_dict, got, d, safetensors=True)
    o["loaded"] = digests(got)
    o["expect_loaded"] = {
        "x": digest(paddle.to_tensor(arr((2, 3), 1))),
        "y": digest(paddle.to_tensor(arr((4,), 2).astype("float16"))),
    }
    return o


ONE = [
    case_model_optimizer,
    case_model_optimizer_nested,
    case_model_flat_keys,
    case_optimizer_with_scheduler,
    case_nested,
    case_non_tensor_values,
    case_not_a_dict,
    case_empty,
    case_dtypes,
    case_complex,
    case_zero_d_and_empty,
    case_odd_keys,
    case_path_is_file,
    case_mismatches,
    case_unique_ids,
    case_save_twice_same_path,
    case_save_twice_other_keys,
    case_safetensors_true,
    case_safetensors_false_explicit,
    case_format_flags_crossed,
    case_offload_and_keywords,
    case_positional,
    case_structure_change,
    case_merge_sharded,
    case_paddle_load_of_files,
    case_sharded_weight_boxes,
    case_master_weight_names,
    case_aoa,
    case_hf_directory,
    case_path_forms,
    case_odd_values,
    case_async_save,
    case_save_replicas_and_safetensors_versions,
]


# ------------------------------------------------------------------------------------------------ two ranks


def shared(d):
    """One directory for all ranks, created before anyone uses it."""
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    return d


def case2_data_parallel(d):
    d = shared(d)
    m, opt = model_and_optimizer(5)  # same seed on every rank: replicated
    sd = {**m.state_dict(), **opt.state_dict()}
    o = roundtrip(d, sd)
    dist.barrier()
    o["files"] = stock_files(d)
    return o


def case2_rank_values_differ(d):
    """Replicated keys whose values differ per rank (a user bug stock resolves by dedup): which value wins."""
    d = shared(d)
    r = dist.get_rank()
    sd = {"w": t([4], 10 + r), "common": t([2], 1)}
    o = {"save": attempt(dist.save_state_dict, sd, d)}
    dist.barrier()
    got = zeros_like(sd)
    o["load"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = digests(got)
    return o


def case2_tensor_parallel_boxes(d):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    d = shared(d)
    r = dist.get_rank()
    full = arr((4, 6), 2)
    sd = {"w": ShardedWeight("w", paddle.to_tensor(full[:, 3 * r : 3 * r + 3]), (4, 3), (4, 6), (0, 3 * r))}
    o = {"save": attempt(dist.save_state_dict, sd, d)}
    dist.barrier()
    o["files"] = stock_files(d)
    # same layout (stock's local fast path), the other rank's half (a reshard), rows instead of columns
    for name, (off, shape) in {
        "same": ((0, 3 * r), (4, 3)),
        "swapped": ((0, 3 * (1 - r)), (4, 3)),
        "rows": ((2 * r, 0), (2, 6)),
    }.items():
        got = ShardedWeight("w", paddle.zeros(shape), shape, (4, 6), off)
        o[f"load_{name}"] = attempt(dist.load_state_dict, {"w": got}, d)
        o[f"loaded_{name}"] = digest(got.local_tensor)
    full_t = {"w": paddle.zeros([4, 6])}
    o["load_full"] = attempt(dist.load_state_dict, full_t, d)
    o["loaded_full"] = digest(full_t["w"])
    return o


def case2_dist_tensors(d):
    d = shared(d)
    mesh = dist.ProcessMesh([0, 1])
    w = dist.shard_tensor(paddle.to_tensor(arr((4, 6), 3)), mesh, [dist.Shard(0)])
    b = dist.shard_tensor(paddle.to_tensor(arr((6,), 4)), mesh, [dist.Replicate()])
    o = {"save": attempt(dist.save_state_dict, {"w": w, "b": b}, d)}
    dist.barrier()
    o["files"] = stock_files(d)
    w2 = dist.shard_tensor(paddle.zeros([4, 6]), mesh, [dist.Shard(1)])
    b2 = dist.shard_tensor(paddle.zeros([6]), mesh, [dist.Replicate()])
    o["load"] = attempt(dist.load_state_dict, {"w": w2, "b": b2}, d)
    o["loaded"] = {"w": digest(w2), "b": digest(b2)}
    return o


def case2_coordinator_and_group(d):
    d = shared(d)
    group = dist.new_group([0, 1])
    sd = {"w": t([4], 7), "b": t([3], 8)}
    o = {"save": attempt(dist.save_state_dict, sd, d, process_group=group, coordinator_rank=1)}
    dist.barrier()
    o["files"] = stock_files(d)
    got = zeros_like(sd)
    o["load"] = attempt(dist.load_state_dict, got, d, process_group=group, coordinator_rank=1)
    o["loaded"] = digests(got)
    return o


def case2_unique_ids(d):
    d = shared(d)
    o = {}
    for uid in (0, 1):
        o[f"save{uid}"] = attempt(dist.save_state_dict, {"w": t([4], 20 + uid)}, d, unique_id=uid)
        dist.barrier()
    for uid in (None, 0, 1):
        got = {"w": paddle.zeros([4])}
        o[f"load{uid}"] = attempt(dist.load_state_dict, got, d, unique_id=uid)
        o[f"loaded{uid}"] = digest(got["w"])
        o[f"expect_loaded{uid}"] = digest(t([4], 20 + (0 if uid == 0 else 1)))
    return o


def case2_safetensors(d):
    d = shared(d)
    r = dist.get_rank()
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    full = arr((4, 2), 6)
    sd = {
        "w": ShardedWeight("w", paddle.to_tensor(full[2 * r : 2 * r + 2]), (2, 2), (4, 2), (2 * r, 0)),
        "b": t([3], 9),
    }
    o = {"save": attempt(dist.save_state_dict, sd, d, safetensors=True)}
    dist.barrier()
    got = {"w": paddle.zeros([4, 2]), "b": paddle.zeros([3])}
    o["load"] = attempt(dist.load_state_dict, got, d, safetensors=True)
    o["loaded"] = digests(got)
    ref = {"w": paddle.zeros([4, 2]), "b": paddle.zeros([3])}
    o["stock_reads"] = attempt(stock_reader(), ref, d, safetensors=True)
    o["stock_read"] = digests(ref)
    return o


def case2_node_local(d):
    """Every rank given its own directory (node-local disks), stock's format."""
    r = dist.get_rank()
    mine = os.path.join(d, f"node{r}")
    full = arr((4, 2), 7)
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    sd = {"w": ShardedWeight("w", paddle.to_tensor(full[2 * r : 2 * r + 2]), (2, 2), (4, 2), (2 * r, 0))}
    o = {"save": attempt(dist.save_state_dict, sd, mine)}
    dist.barrier()
    o["files"] = stock_files(mine)
    got = ShardedWeight("w", paddle.zeros([2, 2]), (2, 2), (4, 2), (2 * r, 0))
    o["load_same"] = attempt(dist.load_state_dict, {"w": got}, mine)
    o["loaded_same"] = digest(got.local_tensor)
    got = ShardedWeight("w", paddle.zeros([2, 2]), (2, 2), (4, 2), (2 * (1 - r), 0))
    o["load_swapped"] = attempt(dist.load_state_dict, {"w": got}, mine)
    o["loaded_swapped"] = digest(got.local_tensor)
    o["expect_loaded_swapped"] = digest(paddle.to_tensor(full[2 * (1 - r) : 4 - 2 * r]))
    return o


def case2_rank_specific_keys(d):
    """Keys only one rank holds (per-rank RNG or pipeline-stage state) next to shared ones."""
    d = shared(d)
    r = dist.get_rank()
    sd = {"shared": t([3], 1), f"only{r}": t([2], 5 + r)}
    o = {"save": attempt(dist.save_state_dict, sd, d)}
    dist.barrier()
    o["files"] = stock_files(d)
    got = zeros_like(sd)
    o["load"] = attempt(dist.load_state_dict, got, d)
    o["loaded"] = digests(got)
    o["expect_loaded"] = digests(sd)
    other = {f"only{1 - r}": paddle.zeros([2])}  # the other rank's key: read from its file
    o["load_other"] = attempt(dist.load_state_dict, other, d)
    o["loaded_other"] = digests(other)
    o["expect_loaded_other"] = {f"only{1 - r}": digest(t([2], 5 + 1 - r))}
    return o


TWO = [
    case2_rank_specific_keys,
    case2_node_local,
    case2_data_parallel,
    case2_rank_values_differ,
    case2_tensor_parallel_boxes,
    case2_dist_tensors,
    case2_coordinator_and_group,
    case2_unique_ids,
    case2_safetensors,
]


# ------------------------------------------------------------------------------------------------ 2 ranks -> 1


def case1_tp_checkpoint_in_one_process(d):
    """WORKDIR is the stock-written directory of a 2-rank run: its column-split checkpoint, read whole."""
    src = os.path.join(os.path.dirname(d), "tensor_parallel_boxes")
    got = {"w": paddle.zeros([4, 6])}
    o = {"load": attempt(dist.load_state_dict, got, src), "loaded": digest(got["w"])}
    o["expect_loaded"] = digest(paddle.to_tensor(arr((4, 6), 2)))
    return o


def case1_dist_tensor_checkpoint_in_one_process(d):
    src = os.path.join(os.path.dirname(d), "dist_tensors")
    got = {"w": paddle.zeros([4, 6]), "b": paddle.zeros([6])}
    o = {"load": attempt(dist.load_state_dict, got, src), "loaded": digests(got)}
    o["expect_loaded"] = {"w": digest(paddle.to_tensor(arr((4, 6), 3))), "b": digest(paddle.to_tensor(arr((6,), 4)))}
    return o


def case1_node_local_checkpoint_in_one_process(d):
    """One node's directory of a node-local save holds only its half: both refuse."""
    got = {"w": paddle.zeros([4, 2])}
    return {
        "load": attempt(dist.load_state_dict, got, os.path.join(os.path.dirname(d), "node_local", "node0")),
        "loaded": digest(got["w"]),
    }


RELOAD = [
    case1_tp_checkpoint_in_one_process,
    case1_dist_tensor_checkpoint_in_one_process,
    case1_node_local_checkpoint_in_one_process,
]


def main() -> None:
    group, work, out = sys.argv[1], sys.argv[2], sys.argv[3]
    cases = {"one": ONE, "two": TWO, "reload": RELOAD}[group]
    only = os.environ.get("STOCK_DIFF_ONLY")
    if group == "two":
        dist.init_parallel_env()
    results = {}
    for case in cases:
        name = case.__name__.split("_", 1)[1]
        if only and name not in only.split(","):
            continue
        CUDA_CALLS[0] = 0
        try:
            obs = case(os.path.join(work, name))
        except Exception:
            obs = {"harness_error": traceback.format_exc(limit=4)}
        results[name] = {"obs": json.loads(json.dumps(obs, default=repr)), "cuda_calls": CUDA_CALLS[0]}
        if group == "two":
            dist.barrier()
    rank = dist.get_rank() if group == "two" else 0
    with open(f"{out}.rank{rank}", "w") as f:
        active = bool(getattr(dist.save_state_dict, "_paddle_fsdp_fork_wrapper", False))
        json.dump({"fork_active": active, "results": results}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
