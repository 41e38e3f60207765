"""The scale simulation: save planning, the commit's index, and each rank's metadata read + load planning, for a
virtual world of thousands of ranks in one process (no data bytes).

Why: the engine has only ever run on a few ranks here; what grows with the world (the index every rank reads, the
commit's work, the load planner) is measured by running the engine's own code for one rank at a time of a
virtual world: a first save's exchange (scale_first_save.py: each rank's columns and own part, the
coordinator's assignment of the world) + ``lay_out_files`` (each rank's own file),
``save_index.index_objects`` (the coordinator's commit), then per sampled loading rank ``read_metadata`` of the
written index (cold: a fresh reader), ``check_coverage`` + ``region_segments`` of its FSDP targets (the load
planner) and the checksum blocks its ranges need (sparse sidecars: the reads are real, the bytes zeros).

The models: the published configs of Qwen3-30B-A3B and Qwen3-235B-A22B (layers, hidden size, attention heads,
128 experts of ``moe_intermediate_size``, vocabulary 151936, untied embeddings), fp32 master weights + AdamW's two
moments, one FSDP unit per decoder layer plus one for embeddings, final norm and head; each unit's flat buffer
(per state) split evenly over the ranks, as FullyShardFusion does.

Usage: ``python tools/ckpt_bench/scale.py [--model NAME] [--worlds 8,64,...] [--reshard 8192:6144] [--json F]``;
``--table F.json`` prints the markdown table of an earlier run.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import tracemalloc

try:
    from .scale_first_save import first_save
    from .scale_store import store_handover
except ImportError:  # run as a script: python tools/ckpt_bench/scale.py
    from scale_first_save import first_save
    from scale_store import store_handover

MODELS = {
    # config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the Hugging Face hub
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, moe=768, experts=128),
    "Qwen3-235B-A22B": dict(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, moe=1536, experts=128),
    # a small model of the same structure, for the unit test of world-size independence
    "tiny-moe": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, moe=32, experts=8, vocab=1000),
}
STATES = ("", ".moment1", ".moment2")  # fp32 master weight, AdamW moments


def units(model: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The FSDP units of ``model``: the root unit, then one per decoder layer; each a list of (name, shape)."""
    c = MODELS[model]
    h, hd, vocab = c["hidden"], c["head_dim"], c.get("vocab", 151936)
    root = [("model.embed_tokens.weight", (vocab, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    out = [root]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        layer = [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (c["heads"] * hd, h)),
            (p + "self_attn.k_proj.weight", (c["kv_heads"] * hd, h)),
            (p + "self_attn.v_proj.weight", (c["kv_heads"] * hd, h)),
            (p + "self_attn.o_proj.weight", (h, c["heads"] * hd)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate.weight", (c["experts"], h)),
        ]
        for e in range(c["experts"]):
            q = f"{p}mlp.experts.{e}."
            layer += [(q + "gate_proj.weight", (c["moe"], h)), (q + "up_proj.weight", (c["moe"], h))]
            layer.append((q + "down_proj.weight", (h, c["moe"])))
        out.append(layer)
    return out


def state_bytes(model: str) -> int:
    return sum(4 * math.prod(s) for u in units(model) for _n, s in u) * len(STATES)


@functools.cache
def _unit_bounds(model: str) -> list[tuple[list, list[int], int]]:
    """Per unit: its (name, shape) list, the flat start of each parameter, and the unit's element count."""
    out = []
    for unit in units(model):
        starts, pos = [], 0
        for _n, s in unit:
            starts.append(pos)
            pos += math.prod(s)
        out.append((unit, starts, pos))
    return out


def rank_records(model: str, world: int, rank: int) -> list[tuple]:
    """The record descriptions (planner wire form) rank ``rank`` of ``world`` holds: per unit and state, the
    parameters its even share of the unit's flat buffer touches, as flat ranges."""
    out = []
    for unit, starts, total in _unit_bounds(model):
        share = -(-total // world)
        a, b = rank * share, min(total, (rank + 1) * share)
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(unit) and starts[i] < b:
            name, shape = unit[i]
            lo, hi = max(a, starts[i]), min(b, starts[i] + math.prod(shape))
            if hi > lo:
                for st in STATES:
                    flat = (lo - starts[i], hi - starts[i])
                    out.append((name + st, "float32", shape, (0,) * len(shape), shape, flat, False))
            i += 1
    return out


def _sparse_sidecars(directory: str, counts: list[int], names: list[str]) -> None:
    from paddle.distributed.fsdp.checkpoint.format.index import sums_name

    for n, name in zip(counts, names):
        with open(os.path.join(directory, sums_name(name)), "wb") as f:
            f.truncate(8 * n)


RNG_KEY = "__fsdp__.rng"


@functools.cache
def rank_values_entry() -> dict:
    """The per-rank values of the one-call API: this process's random state (state/rng.py's capture)."""
    from paddle.distributed.fsdp.state import rng

    return {RNG_KEY: rng.capture()}


def _rank_values_objects(directory: str, world: int, handovers: dict) -> int:
    """Each rank's own values object (written by the ranks in parallel: not timed); their receipts go with the
    hand-overs. Returns the bytes of one object."""
    from paddle.distributed.fsdp.checkpoint.format import rank_values

    for r in range(world):
        blob = rank_values.encode_entry("0" * 32, r, rank_values_entry())
        with open(os.path.join(directory, rank_values.object_name(r)), "wb") as f:
            f.write(blob)
        handovers[r]["values"] = rank_values.entry_receipt(blob)
    return len(blob)


def _stock_index(plan, world: int) -> int:
    """Bytes of stock paddle's ``0.metadata`` for ``plan`` (the coordinator's work of write_stock_metadata)."""
    from paddle.distributed.fsdp.checkpoint.save.commit import stock_view
    from paddle.distributed.fsdp.checkpoint.stock_compat import stock_metadata_bytes

    return len(stock_metadata_bytes(stock_view(plan, "0" * 32, world)))


def save_side(
    model: str, world: int, directory: str, chunk: int, rank_values: bool = True, stock_index: bool = True
) -> dict:
    """Every rank's first-save planning (the same on every rank), each rank's own layout, and the coordinator's
    commit (hand-overs read from a real TCP store, the index built and written into ``directory`` with sparse
    sidecars). ``rank_values``: every rank saves its RNG state as a per-rank value (as save_checkpoint does).
    ``stock_index``: measure what ``write_stock_metadata=True`` (the default) adds to the coordinator's commit.
    Returns the timings and sizes."""
    from paddle.distributed.fsdp.checkpoint import planner
    from paddle.distributed.fsdp.checkpoint.format.commit import commit_record
    from paddle.distributed.fsdp.checkpoint.save_index import assignment_columns, index_objects

    gc.collect()
    wires = [rank_records(model, world, r) for r in range(world)]
    assignment, first = first_save(wires, sorted({1, world // 2, world - 1} - {0}) or [0])
    t1 = time.perf_counter()
    chunk = chunk or planner.chunk_for(assignment)  # 0: what save_state_dict picks
    planner.lay_out_files(assignment, {}, "0" * 32, world // 2)  # every rank: its own file
    t2 = time.perf_counter()
    t_stock = time.perf_counter()
    plan = planner.lay_out_files(assignment, {}, "0" * 32)  # every file: what write_stock_metadata costs ...
    handovers = {r: {"size": plan.files[r].size, "header": len(plan.files[r].header)} for r in range(world)}
    stock = _stock_index(plan, world) if stock_index else None  # ... with the pickle of 0.metadata
    stock_s = time.perf_counter() - t_stock
    names = [plan.files[r].name for r in range(world)]
    del plan
    header = dict(checkpoint_id="0" * 32, created_unix=0.0, world_size=world, chunk_bytes=chunk)
    header.update(checksum="xxh3-64", values={})
    gc.collect()
    t3 = time.perf_counter()
    cols = assignment_columns(assignment, chunk)  # first save of this assignment; remembered after
    t4 = time.perf_counter()
    for r in range(world):
        handovers[r]["sums"] = cols["files"][r][2]
    entry_bytes = _rank_values_objects(directory, world, handovers) if rank_values else 0
    wait_s = store_handover(world, handovers)
    t5 = time.perf_counter()
    if rank_values:  # the coordinator's table of the ranks' values objects (save/commit.py's _index)
        from paddle.distributed.fsdp.checkpoint.format.rank_values import encode_table

        header["rank_values"] = ([RNG_KEY], encode_table([handovers[r]["values"] for r in range(world)]))
    objects = index_objects(cols, header, handovers, True)
    t6 = time.perf_counter()
    for name, blob in objects.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(blob)
    with open(os.path.join(directory, "COMMIT"), "wb") as f:
        f.write(commit_record("0" * 32, objects["metadata.json"]))
    _sparse_sidecars(directory, [c for _n, _d, c in cols["files"]], names)
    exchange = len(planner.descs_digest(wires[0])) + 16  # digest + assignment name per rank (repeated saves)
    del wires, assignment
    return {
        "pieces": int(len(cols["rows"])),
        **first,
        "layout_rank_s": t2 - t1,
        "columns_s": t4 - t3,
        "handover_s": wait_s,
        "commit_index_s": t6 - t5,
        "commit_s": wait_s + (t6 - t5),
        "commit_bytes": sum(len(b) for b in objects.values()),
        "index_bytes": {k: len(v) for k, v in objects.items()},
        "exchange_bytes_per_rank": exchange,
        "chunk_bytes": chunk,
        "handover_bytes_per_rank": max(len(json.dumps(h)) for h in handovers.values()),
        "rank_values_bytes_per_rank": entry_bytes,
        "stock_s": stock_s if stock_index else None,  # coordinator: every file laid out + 0.metadata pickled
        "stock_bytes": stock,
    }


def _seg(sg) -> tuple:
    """``(piece, src, length)`` of one of region_segments' results (a 5-tuple, or a typed Segments)."""
    if hasattr(sg, "piece"):
        return sg.piece, sg.src, sg.length
    return sg[0], sg[1], sg[3]


def load_rank(directory: str, model: str, world: int, rank: int, memory: bool = False) -> dict:
    """One loading rank of ``world``: read the metadata cold, plan its FSDP targets, fetch the checksum blocks
    of the ranges it reads. Figures: metadata bytes (index; own checksum ranges apart), time, files opened."""
    from paddle.distributed.fsdp.checkpoint import directory as ckdir
    from paddle.distributed.fsdp.checkpoint.load.load import check_coverage
    from paddle.distributed.fsdp.checkpoint.planner import Region
    from paddle.distributed.fsdp.checkpoint.regions import region_segments

    targets = [(w[0], Region(w[2], w[3], w[4], w[5])) for w in rank_records(model, world, rank)]
    gc.collect()
    if memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    md = ckdir.read_metadata(directory)
    keys = [k for k, _r in targets]
    check_coverage(directory, md, keys, dict(targets))  # (as load/job.py: the regions this rank loads)
    segs = [(key, region_segments(directory, md, key, reg)) for key, reg in targets]
    t1 = time.perf_counter()
    index_bytes, index_objects = md.index.fetch.bytes, set(md.index.fetch.objects)
    by_object = {
        k: md.index.fetch.by_object.get(k, 0) for k in ("index.keys", "index.fences", "index.starts", "index.pieces")
    }
    if md.rank_values is not None:  # the one-call API's resume: this rank's RNG state (rng.decode)
        md.values[RNG_KEY][rank]
    values_bytes = md.index.fetch.bytes - index_bytes
    values_objects = set(md.index.fetch.objects) - index_objects
    t2 = time.perf_counter()
    chunk, data_files, own_bytes = md.chunk_bytes, set(), 0
    for _key, ss in segs:
        for piece, src, length in map(_seg, ss):
            data_files.add(piece.file)
            for a, n in zip(src.tolist(), length.tolist()):
                piece.checksums[a // chunk]  # the blocks of checksums this range needs (fetched on first use)
                piece.checksums[max(a, a + n - 1) // chunk]
                own_bytes += n
    peak = tracemalloc.get_traced_memory()[1] if memory else 0
    if memory:
        tracemalloc.stop()
    return {
        "rank": rank,
        "plan_s": t1 - t0,
        "rank_values_s": t2 - t1,
        "index_bytes": index_bytes,
        "index_by_object": by_object,  # (metadata.json: the rest of index_bytes)
        "rank_values_bytes": values_bytes,
        "rank_values_objects": len(values_objects),
        "sums_bytes": md.index.fetch.bytes - index_bytes - values_bytes,
        "objects": len(md.index.fetch.objects),
        "index_objects": len(index_objects),
        "files_opened": len(md.index.fetch.objects) + len(data_files),
        "share_bytes": own_bytes,
        "peak_bytes": peak,
    }


def reshard_reads(directory: str, model: str, world: int) -> dict:
    """Every rank of ``world`` loading the checkpoint in ``directory`` (saved by another world): bytes each
    reads (its ranges widened to whole checksum chunks, as a verified load reads them) against its share, and
    whether any byte is read by two ranks beyond that widening (one shared reader: the plan of each rank is
    the same computation as in ``load_rank``, without the repeated metadata read)."""
    from paddle.distributed.fsdp.checkpoint import directory as ckdir
    from paddle.distributed.fsdp.checkpoint.planner import Region
    from paddle.distributed.fsdp.checkpoint.regions import region_segments

    md = ckdir.read_metadata(directory)
    md.prefetch(list(md.tensors))
    chunk = md.chunk_bytes
    worst, total_read, total_share, exact_overlap = 0.0, 0, 0, 0
    seen: dict[tuple[str, int], int] = {}  # (file, offset) -> end of the exact range read there
    for rank in range(world):
        share = read = 0
        for w in rank_records(model, world, rank):
            segs = region_segments(directory, md, w[0], Region(w[2], w[3], w[4], w[5]))
            for piece, src, length in map(_seg, segs):
                for a, n in zip(src.tolist(), length.tolist()):
                    share += n
                    a0, b0 = (a // chunk) * chunk, min(-(-(a + n) // chunk) * chunk, piece.nbytes)
                    read += b0 - a0
                    k = (piece.file, piece.offset + a)
                    if k in seen:
                        exact_overlap += n
                    seen[k] = piece.offset + a + n
        total_read += read
        total_share += share
        worst = max(worst, read / share if share else 1.0)
    return {
        "world": world,
        "max_read_over_share": worst,
        "read_over_state": total_read / total_share,
        "bytes_read_twice_exact": exact_overlap,
        "state_bytes": total_share,
    }


def run(
    model: str, worlds: list[int], samples: int, chunk: int, reshard: tuple[int, int] | None, stock_max: int
) -> dict:
    out = {"model": model, "state_bytes": state_bytes(model), "chunk_bytes": chunk, "worlds": []}
    for world in worlds:
        d = tempfile.mkdtemp(prefix=f"scale-{world}-")
        try:
            save = save_side(model, world, d, chunk, stock_index=world <= stock_max)
            ranks = sorted({0, world // 2, world - 1} | set(range(0, world, max(1, world // samples))))[:samples]
            loads = [load_rank(d, model, world, r) for r in ranks]
            mem = load_rank(d, model, world, ranks[0], memory=True)["peak_bytes"]
            row = {"world": world, **save, "loads": loads, "peak_bytes": mem}
            if reshard and reshard[0] == world:
                row["reshard"] = reshard_reads(d, model, reshard[1])
            out["worlds"].append(row)
            print(json.dumps(_summary(row)), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def _summary(row: dict) -> dict:
    loads = row["loads"]
    return {
        "world": row["world"],
        "pieces": row["pieces"],
        "chunk_KiB": row["chunk_bytes"] >> 10,
        "index_read_MB": max(x["index_bytes"] for x in loads) / 1e6,
        "own_sums_KB": max(x["sums_bytes"] for x in loads) / 1e3,
        "rank_values_KB": max(x.get("rank_values_bytes", 0) for x in loads) / 1e3,
        "plan_s": max(x["plan_s"] for x in loads),
        "peak_MB": row["peak_bytes"] / 1e6,
        "files_opened": max(x["files_opened"] for x in loads),
        "first_rank_s": row["first_rank_s"],
        "first_coordinator_s": row["first_coordinator_s"],
        "first_rank_recv_KB": row["first_rank_recv_bytes"] / 1e3,
        "first_coordinator_recv_MB": row["first_coordinator_recv_bytes"] / 1e6,
        "first_old_recv_MB": row["first_old_recv_bytes"] / 1e6,
        "layout_rank_s": row["layout_rank_s"],
        "columns_s": row["columns_s"],
        "handover_s": row["handover_s"],
        "commit_index_s": row["commit_index_s"],
        "commit_s": row["commit_s"],
        "commit_MB": row["commit_bytes"] / 1e6,
        "stock_s": row.get("stock_s"),
        "stock_MB": None if row.get("stock_bytes") is None else row["stock_bytes"] / 1e6,
        **({"reshard": row["reshard"]} if "reshard" in row else {}),
    }


def growth(rows: list[dict], field, lo: int = 512, hi: int = 8192) -> float | None:
    """Exponent k of field ~ world^k between worlds ``lo`` and ``hi`` (None if either is missing)."""
    by = {r["world"]: field(r) for r in rows}
    if lo not in by or hi not in by or by[lo] <= 0:
        return None
    return math.log(by[hi] / by[lo]) / math.log(hi / lo)


def _stock_cell(x: dict) -> str:
    if x.get("stock_s") is None:
        return "not measured"
    return f"{x['stock_s']:.1f} s, {x['stock_MB']:.0f} MB"


def markdown(res: dict) -> str:
    """The table of a run (docs/performance.md, docs/reports/scale-*.md): per world the worst sampled loading rank and the
    coordinator."""
    out = [
        f"{res['model']}, {res['state_bytes'] / 1e12:.2f} TB of state (fp32 master + AdamW moments):",
        "",
        "| world | pieces | chunk | index read / rank | own per-rank values read | own checksums read | plan / rank "
        "| peak mem / rank | files opened / rank | first save / rank | first save: coordinator assign | first-save "
        "bytes received / rank | (before: every rank) | first-save bytes received (coordinator) | columns "
        "(coordinator, first save) | hand-over reads (coordinator) | index (coordinator) | commit bytes written | "
        "+ stock 0.metadata (coordinator) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["worlds"]:
        x = _summary(r)
        out.append(
            f"| {x['world']} | {x['pieces']:,} | {x['chunk_KiB']} KiB | {x['index_read_MB']:.2f} MB | "
            f"{x['rank_values_KB']:.1f} KB | {x['own_sums_KB']:.0f} KB | {x['plan_s']:.2f} s | {x['peak_MB']:.0f} MB | "
            f"{x['files_opened']} | {x['first_rank_s'] * 1e3:.1f} ms | {x['first_coordinator_s']:.1f} s | "
            f"{x['first_rank_recv_KB']:.1f} KB | {x['first_old_recv_MB']:.0f} MB | {x['first_coordinator_recv_MB']:.1f} MB | "
            f"{x['columns_s']:.1f} s | {x['handover_s']:.2f} s | {x['commit_index_s']:.2f} s"
            f" | {x['commit_MB']:.0f} MB | {_stock_cell(x)} |"
        )
    g = res.get("growth_512_8192", {})
    if any(v is not None for v in g.values()):
        out += [
            "",
            "Growth exponent 512 -> 8192 ranks (k in cost ~ world^k): "
            + ", ".join(f"{k} {v:.2f}" for k, v in g.items() if v is not None),
        ]
    for r in res["worlds"]:
        if "reshard" in r:
            x = r["reshard"]
            out += [
                "",
                f"Reshard {r['world']} -> {x['world']} ranks: worst rank reads {x['max_read_over_share']:.3f}x "
                f"its share, all ranks together {x['read_over_state']:.4f}x the state, "
                f"{x['bytes_read_twice_exact']} bytes of the exact ranges read by two ranks",
            ]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen3-235B-A22B", choices=sorted(MODELS))
    p.add_argument("--worlds", default="8,64,512,2048,8192")
    p.add_argument("--samples", type=int, default=3, help="loading ranks measured per world (default 3)")
    p.add_argument("--chunk-bytes", type=int, default=0, help="checksum chunk (default 0: what a save picks)")
    p.add_argument("--reshard", default="8192:6144", help="FROM:TO worlds of the reshard check ('' skips it)")
    p.add_argument(
        "--stock-max-world", type=int, default=2048, help="measure 0.metadata up to this world (memory: ~GBs)"
    )
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="print the markdown table of this JSON result and exit")
    a = p.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            print(markdown(json.load(f)))
        return 0
    reshard = tuple(int(x) for x in a.reshard.split(":")) if a.reshard else None
    res = run(a.model, [int(w) for w in a.worlds.split(",")], a.samples, a.chunk_bytes, reshard, a.stock_max_world)
    rows = res["worlds"]
    res["growth_512_8192"] = {
        "index_read": growth(rows, lambda r: max(x["index_bytes"] for x in r["loads"])),
        "plan_s": growth(rows, lambda r: max(x["plan_s"] for x in r["loads"])),
        "commit_s": growth(rows, lambda r: r["commit_s"]),
        "commit_bytes": growth(rows, lambda r: r["commit_bytes"]),
        "first_save_rank_s": growth(rows, lambda r: r["first_rank_s"]),
        "first_save_rank_recv": growth(rows, lambda r: r["first_rank_recv_bytes"]),
        "first_save_coordinator_s": growth(rows, lambda r: r["first_coordinator_s"]),
    }
    print(json.dumps({"summary": [_summary(r) for r in rows], "growth": res["growth_512_8192"]}, indent=1))
    print(markdown(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
