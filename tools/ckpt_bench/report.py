"""The report: the markdown table on stdout and the ``--json`` file, from the phases' raw measurements."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil

from .common import GB, LOG, RAW_READ_VARIANTS, median


def finish(args, res: dict, work: str) -> None:
    cfg = res["config"]
    S = cfg["state_bytes"]
    ph = res["phases"]
    med = {k: median(v["seconds"]) for k, v in ph.items()}
    fl = res.get("fresh_loads", {})
    tor = res.get("torch") or {}
    tsame, tchg = tor.get("same"), tor.get("changed")
    W, M = cfg["world"], cfg["load_world"]
    rows = []

    def row(name, secs, limit=None, torch_s=None, note=""):
        rows.append(
            {
                "name": name,
                "seconds": secs,
                "median_s": median(secs),
                "gbps": S / median(secs) / GB,
                "vs_limit": (limit / median(secs)) if limit else None,
                "vs_torch": (torch_s / median(secs)) if torch_s else None,
                "note": note,
            }
        )

    def loads(name):
        return [r["load"] for r in fl.get(name, [])]

    def raw_of(r, variant):
        """A launch's raw read: the mean of the reads before and after its load (A-B-A) when both were made."""
        after = r.get("raw_after", {}).get(variant)
        return r["raw"][variant] if after is None else (r["raw"][variant] + after) / 2

    def raws(name, variant):
        return [raw_of(r, variant) for r in fl.get(name, []) if variant in r["raw"]]

    def best_raw(name):
        """The faster raw-read variant of a fresh-load configuration: (variant, seconds list)."""
        cands = [(v, raws(name, v)) for v in RAW_READ_VARIANTS if raws(name, v)]
        return min(cands, key=lambda c: median(c[1]))

    def paired(name, variant):
        """Per launch: raw read time / load time, both measured in the same fresh process."""
        return sorted(raw_of(r, variant) / r["load"] for r in fl.get(name, []))

    # the limit for saves: the faster raw write (buffered into the page cache, or O_DIRECT from one reused buffer)
    write_variants = [v for v in ("raw write+fsync", "raw write+fsync, O_DIRECT") if v in ph]
    lim_w_name = min(write_variants, key=lambda v: med[v])
    lim_w = med[lim_w_name]
    ts = median(tsame["save"]) if tsame else None
    tl = median(tsame["load"]) if tsame and tsame.get("load") else None
    tl2 = median(tchg["load"]) if tchg and tchg.get("load") else None
    for v in write_variants:
        row(f"{v} ({W} ranks)", ph[v]["seconds"], lim_w, ts, "limit for saves" if v == lim_w_name else "")
    row("save sync", ph["save sync"]["seconds"], lim_w, ts)
    row("save async, total", ph["save async (total)"]["seconds"], lim_w, ts)
    if "all_gather + paddle.save" in ph:
        row("all_gather + paddle.save (rank 0)", ph["all_gather + paddle.save"]["seconds"], lim_w, ts, "pre-fork")
    if tsame:
        row(f"torch DCP save ({W} ranks)", tsame["save"], lim_w, ts)
    same_var, same_raw = best_raw("same") if fl.get("same") else (None, None)
    lim_r = median(same_raw) if same_raw else None
    for v in RAW_READ_VARIANTS:
        if raws("same", v):
            row(f"raw read ({W} ranks, {v}, cold)", raws("same", v), lim_r, tl, "limit" if v == same_var else "")
    if fl.get("same"):
        row(f"load ({W} ranks, cold)", loads("same"), lim_r, tl, "first load of a fresh process")
    if fl.get("atomic"):
        row(f"load ({W} ranks, cold, atomic=True)", loads("atomic"), lim_r, tl, "undo copy of the slice")
    if tl:
        row(f"torch DCP load ({W} ranks, cold)", tsame["load"], lim_r, tl, "fresh process")
    lim_warm = median(raws("warm", "resident")) if fl.get("warm") else None
    if fl.get("warm"):
        row(f"plain read ({W} ranks, warm cache)", raws("warm", "resident"), lim_warm, None, "limit, warm")
        row(f"load ({W} ranks, warm cache)", loads("warm"), lim_warm, None, "first load of a fresh process")
    if fl.get("warm, unverified"):
        row(
            f"load ({W} ranks, warm cache, verify_checksums=False)",
            loads("warm, unverified"),
            lim_warm,
            None,
            "what checksums cost",
        )
    lim_r2 = None
    if fl.get("changed"):
        chg_var, chg_raw = best_raw("changed")
        lim_r2 = median(chg_raw)
        for v in RAW_READ_VARIANTS:
            if raws("changed", v):
                row(
                    f"raw read ({M} ranks, {v}, cold)", raws("changed", v), lim_r2, tl2, "limit" if v == chg_var else ""
                )
        row(f"load {W}->{M} ranks (cold)", loads("changed"), lim_r2, tl2, "first load of a fresh process")
        if tl2:
            row(f"torch DCP load {W}->{M} ranks (cold)", tchg["load"], lim_r2, tl2, "fresh process")

    mc = median(res["memcpy"]["prealloc_s"])
    mcf = median(res["memcpy"]["fresh_s"])
    blocked = median(ph["save async (blocked)"]["seconds"])
    rank_bytes = cfg["rank_bytes"]
    targets = []

    def target(name, value, goal, ok, detail=""):
        targets.append({"target": name, "measured": value, "goal": goal, "met": bool(ok), "detail": detail})

    def r_of(title):
        return next((r for r in rows if r["name"] == title), None)

    def span(xs):
        return f"per run {median(xs):.2f}x, {xs[0]:.2f}-{xs[-1]:.2f}x"

    s = r_of("save sync")
    per_round = sorted(a / b for a, b in zip(ph[lim_w_name]["seconds"], ph["save sync"]["seconds"]))
    target(
        f"sync save >= 0.95x {lim_w_name}",
        f"{s['vs_limit']:.2f}x (paired per round: {span(per_round)})",
        ">= 0.95x",
        s["vs_limit"] >= 0.95,
    )
    ld = r_of(f"load ({W} ranks, cold)")
    if ld:
        target(
            f"load ({W} ranks, cold) >= 0.9x raw read",
            f"{ld['vs_limit']:.2f}x (same process, {same_var}: {span(paired('same', same_var))})",
            ">= 0.90x",
            ld["vs_limit"] >= 0.9,
        )
        if ld["vs_torch"]:
            target(
                f"load ({W} ranks, cold) >= 1.5x torch DCP", f"{ld['vs_torch']:.2f}x", ">= 1.50x", ld["vs_torch"] >= 1.5
            )
    l2 = r_of(f"load {W}->{M} ranks (cold)")
    if l2:
        target(
            f"load {W}->{M} ranks >= 0.85x raw read",
            f"{l2['vs_limit']:.2f}x (same process, {chg_var}: {span(paired('changed', chg_var))})",
            ">= 0.85x",
            l2["vs_limit"] >= 0.85,
        )
    lw = r_of(f"load ({W} ranks, warm cache)")
    if lw:
        target(
            "warm-cache load >= 0.85x plain read",
            f"{lw['vs_limit']:.2f}x (same process: {span(paired('warm', 'resident'))})",
            ">= 0.85x",
            lw["vs_limit"] >= 0.85,
        )
    per_round = sorted(b / m for b, m in zip(ph["save async (blocked)"]["seconds"], res["memcpy"]["prealloc_s"]))
    target(
        "async save blocks <= 0.1x memcpy",
        f"{blocked * 1000:.1f} ms = {blocked / mc:.3f}x memcpy ({mc:.3f} s; per round {median(per_round):.3f}x, "
        f"{per_round[0]:.3f}-{per_round[-1]:.3f}x)",
        "<= 0.10x",
        blocked <= 0.1 * mc,
    )
    # memory of loads: the engine's own account (LoadReport.peak_host_bytes) against max(64 MiB, 2%)
    for name in ("same", "warm", "changed"):
        runs = fl.get(name, [])
        if not runs:
            continue
        worst = max(e["peak"] / e["budget"] for r in runs for e in r["engine_host"])
        peak = max(e["peak"] for r in runs for e in r["engine_host"])
        budget = min(e["budget"] for r in runs for e in r["engine_host"])
        target(
            f"load ({name}) extra host memory <= max(64 MiB, 2%)",
            f"{peak / 2**20:.1f} MiB engine peak (budget {budget / 2**20:.0f} MiB; {worst:.0%} of it)",
            "<= budget",
            worst <= 1.0,
        )

    # ---- print
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines = []
    lines.append(
        f"Checkpoint benchmark, {date}, {platform.node()} ({os.cpu_count()} cores), "
        f"paddle {_paddle_version()}" + (f", torch {tor.get('version')}" if tor else "")
    )
    lines.append(
        f"state: {S / GB:.3f} GB ({cfg['blocks']} x Linear({cfg['dim']}, {cfg['dim']}) + AdamW, fp32), "
        f"{W} ranks, changed world {M}, medians of {cfg['repeats']} runs; every load is the first of a fresh "
        f"process, each raw read the mean of one right before and one right after that load in its process; page "
        f"cache: {res.get('drop_method')}; cached before cold reads: {_cache_summary(fl)}; load "
        f"average {res['loadavg']['start'][0]:.2f} at start, {res['loadavg']['end'][0]:.2f} before the child jobs"
    )
    lines.append("")
    lines.append("| phase | seconds (median, min-max) | GB/s | x limit | x torch DCP |")
    lines.append("|---|---|---|---|---|")
    for r in rows:
        sec = r["seconds"]
        name = r["name"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(
            f"| {name} | {r['median_s']:.3f} ({min(sec):.3f}-{max(sec):.3f}) | {r['gbps']:.2f} | "
            f"{_x(r['vs_limit'])} | {_x(r['vs_torch'])} |"
        )
    lines.append(f"| save async, caller blocked | {blocked:.4f} | - | {blocked / mc:.3f}x memcpy | - |")
    lines.append(
        f"| host memcpy of rank state (prealloc / fresh) | {mc:.3f} / {mcf:.3f} | "
        f"{S / W / mc / GB:.2f} / {S / W / mcf / GB:.2f} per rank | - | - |"
    )
    if res.get("overlap"):
        ov = res["overlap"]
        lines.append(
            f"| compute speed during async persistence | {ov['total_s']:.3f} total | - | "
            f"{', '.join(f'{x:.0%}' for x in ov['relative'])} of idle | - |"
        )
    lines.append("")
    lines.append("| extra host memory, per rank (MiB) | peak RSS over baseline | engine account | rank state |")
    lines.append("|---|---|---|---|")
    rb = ", ".join(f"{b / 2**20:.0f}" for b in rank_bytes)

    def rss_extra(name):
        runs = res["rss"].get(name, [])
        return [max(r[i]["extra"] for r in runs) for i in range(len(runs[0]))] if runs else []

    def mib(xs):
        return ", ".join(f"{x / 2**20:.1f}" for x in xs)

    lines.append(f"| save sync | {mib(rss_extra('save sync'))} | - | {rb} |")
    lines.append(f"| save async (snapshot buffer) | {mib(rss_extra('save async'))} | - | {rb} |")
    for name, title in (
        ("same", f"load {W} ranks, cold"),
        ("warm", f"load {W} ranks, warm"),
        ("changed", f"load {W}->{M} ranks"),
        ("atomic", f"load {W} ranks, atomic=True"),
    ):
        runs = fl.get(name, [])
        if not runs:
            continue
        n = len(runs[0]["rss"])
        rss = [max(r["rss"][i]["extra"] for r in runs) for i in range(n)]
        eng = [max(r["engine_host"][i]["peak"] for r in runs) for i in range(n)]
        sl = ", ".join(f"{runs[0]['rss'][i]['slice'] / 2**20:.0f}" for i in range(n))
        lines.append(f"| {title} | {mib(rss)} | {mib(eng)} | {sl} |")
    if tsame and tsame.get("rss_save"):
        ts_x = [max(r[i]["extra"] for r in tsame["rss_save"]) for i in range(W)]
        lines.append(f"| torch DCP save | {mib(ts_x)} | - | {rb} |")
    if tsame and tsame.get("rss_load"):
        tl_x = [max(r[i]["extra"] for r in tsame["rss_load"]) for i in range(W)]
        lines.append(f"| torch DCP load | {mib(tl_x)} | - | {rb} |")
    if "all_gather + paddle.save" in res["rss"]:
        lines.append(f"| all_gather + paddle.save | {mib(rss_extra('all_gather + paddle.save'))} | - | {rb} |")
    if res.get("many_keys"):
        from .many_keys import summary as many_keys_summary

        lines.append("")
        lines.append(many_keys_summary(res["many_keys"], tor.get("many_keys")))
    if res.get("hsdp"):
        from .hsdp import summary as hsdp_summary

        lines.append("")
        lines.extend(hsdp_summary(res["hsdp"]))
    if res.get("train_loop"):
        from .train_loop import table as train_table

        lines.append("")
        lines.append(
            f"training loop: {res['train_loop'][0]['steps']} steps, an async checkpoint every "
            f"{res['train_loop'][0]['every']} ({res['train_loop'][0]['ckpts_per_loop']} per loop), state "
            f"{getattr(args, 'train_size_gib', None) or cfg['size_gib']} GiB; medians of the loops"
        )
        lines.append("")
        lines.append(train_table(res["train_loop"]))
    lines.append("")
    lines.append("| target | measured | goal | met |")
    lines.append("|---|---|---|---|")
    for t in targets:
        lines.append(f"| {t['target']} | {t['measured']} | {t['goal']} | {'yes' if t['met'] else 'NO'} |")
    lines += _trace_summary(res)
    print("\n".join(lines), flush=True)
    if args.json:
        out = {
            "date": date,
            "host": platform.node(),
            "cores": os.cpu_count(),
            "paddle": _paddle_version(),
            "rows": rows,
            "targets": targets,
            "memcpy": res["memcpy"],
            "rss_method": res.get("rss_method"),
            "drop_method": res.get("drop_method"),
            **{k: res[k] for k in res if k not in ("memcpy",)},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        LOG.info("results written to %s", args.json)
    if not args.keep and args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


def _x(v):
    return f"{v:.2f}x" if v else "-"


def _paddle_version():
    try:
        import paddle

        return paddle.__version__
    except ImportError:
        return "?"


def _cache_summary(fl) -> str:
    vals = [
        x for name, runs in fl.items() if not name.startswith("warm") for r in runs for x in r["cache"] if x is not None
    ]
    return f"max {max(vals):.1%} of pages" if vals else "unknown"


def _trace_summary(res) -> list[str]:
    """Median engine phase timings (rank 0 and 1) from the engine's trace hook."""
    out = []
    groups = dict(res.get("trace", {}))
    for name, runs in res.get("fresh_loads", {}).items():
        groups[f"load {name}"] = [r["trace"] for r in runs if r.get("trace")]
    for name, runs in groups.items():
        per_what: dict = {}
        for run in runs:
            for rank, recs in enumerate(run):
                for rec in recs:
                    d = per_what.setdefault((rec["what"], rank), {})
                    for m, v in rec["marks"].items():
                        d.setdefault(m, []).append(v)
                    d.setdefault("total", []).append(rec["total"])
        if not per_what:
            continue
        if not out:
            out += ["", "engine phases (trace hook, median ms):"]
        for (what, rank), d in sorted(per_what.items(), key=lambda x: (x[0][1], x[0][0])):
            if rank > 1:
                continue
            out.append(
                f"  {name:>12} | {what} [rank {rank}]: " + " ".join(f"{m}={median(v) * 1000:.1f}" for m, v in d.items())
            )
    return out
