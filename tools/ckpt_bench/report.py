"""The report: the markdown table on stdout and the ``--json`` file, from the phases' raw measurements."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil

from .common import GB, LOG, median


def finish(args, res: dict, work: str) -> None:
    cfg = res["config"]
    S = cfg["state_bytes"]
    ph = res["phases"]
    med = {k: median(v["seconds"]) for k, v in ph.items()}
    cw = res.get("changed_world")
    tor = res.get("torch") or {}
    tsame, tchg = tor.get("same"), tor.get("changed")
    M = cfg["load_world"]
    rows = []  # (name, seconds list, limit seconds, torch seconds)

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

    W = cfg["world"]

    def best_raw(d):
        """The faster raw-read variant: (name, seconds list)."""
        cands = [(v, d[f"raw read ({v})"]) for v in ("resident", "ring") if d.get(f"raw read ({v})")]
        return min(cands, key=lambda c: median(c[1]))

    raw_same = best_raw({k: v["seconds"] for k, v in ph.items()})
    raw_chg = best_raw(cw) if cw else None
    lim_w, lim_r = med["raw write+fsync"], median(raw_same[1])
    lim_r2 = median(raw_chg[1]) if cw else None
    ts = median(tsame["save"]) if tsame else None
    tl = median(tsame["load"]) if tsame else None
    tl2 = median(tchg["load"]) if tchg else None
    row(f"raw write+fsync ({W} ranks)", ph["raw write+fsync"]["seconds"], lim_w, ts, "limit for saves")
    row("save sync", ph["save sync"]["seconds"], lim_w, ts)
    row("save async, total", ph["save async (total)"]["seconds"], lim_w, ts)
    if "all_gather + paddle.save" in ph:
        row("all_gather + paddle.save (rank 0)", ph["all_gather + paddle.save"]["seconds"], lim_w, ts, "pre-fork")
    if tsame:
        row(f"torch DCP save ({W} ranks)", tsame["save"], lim_w, ts)
    for v in ("resident", "ring"):
        row(
            f"raw read ({W} ranks, {v})",
            ph[f"raw read ({v})"]["seconds"],
            lim_r,
            tl,
            "limit for loads" if v == raw_same[0] else "",
        )
    row(f"load ({W} ranks)", ph["load"]["seconds"], lim_r, tl, "staging: async-save buffer")
    if "load (fresh staging)" in ph:
        row(f"load ({W} ranks, fresh staging)", ph["load (fresh staging)"]["seconds"], lim_r, tl)
    if tsame:
        row(f"torch DCP load ({W} ranks)", tsame["load"], lim_r, tl)
    if cw:
        for v in ("resident", "ring"):
            row(
                f"raw read ({M} ranks, {v})",
                cw[f"raw read ({v})"],
                lim_r2,
                tl2,
                "limit, changed world" if v == raw_chg[0] else "",
            )
        row(f"load {W}->{M} ranks", cw["load"], lim_r2, tl2)
        if tchg:
            row(f"torch DCP load {W}->{M} ranks", tchg["load"], lim_r2, tl2)

    mc = median(res["memcpy"]["prealloc_s"])
    mcf = median(res["memcpy"]["fresh_s"])
    blocked = median(ph["save async (blocked)"]["seconds"])

    def rss_extra(name):
        runs = res["rss"].get(name, [])
        return [max(r[i]["extra"] for r in runs) for i in range(len(runs[0]))] if runs else []

    rank_bytes = cfg["rank_bytes"]
    save_extra = rss_extra("save sync")
    async_extra = rss_extra("save async")
    load_extra = rss_extra("load")
    fresh_extra = rss_extra("load (fresh staging)")
    chunk_bound = 64 << 20  # the engine's largest read window (reader.DEFAULT_WINDOW)
    cw_extra = []
    if cw:
        n = len(cw["rss"][0])
        cw_extra = [max(r[i]["extra"] for r in cw["rss"]) for i in range(n)]
        cw_slice = cw["rss"][0]
    targets = []

    def target(name, value, goal, ok, detail=""):
        targets.append({"target": name, "measured": value, "goal": goal, "met": bool(ok), "detail": detail})

    def r_of(title):
        return next((r for r in rows if r["name"] == title), None)

    def paired(limit_phase, phase):
        """Per-round speed ratios (limit time / phase time, both measured in the same round): drift of the
        machine between rounds cancels; shown next to the ratio of medians."""
        lim, got = ph[limit_phase]["seconds"], ph[phase]["seconds"]
        ratios = sorted(a / b for a, b in zip(lim, got))
        return f" (paired per round: median {median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f}x)"

    s = r_of("save sync")
    target(
        "save >= 0.9x raw write+fsync",
        f"{s['vs_limit']:.2f}x" + paired("raw write+fsync", "save sync"),
        ">= 0.90x",
        s["vs_limit"] >= 0.9,
    )
    if s["vs_torch"]:
        target("save >= 1.5x torch DCP", f"{s['vs_torch']:.2f}x", ">= 1.50x", s["vs_torch"] >= 1.5)
    for title in (f"load ({W} ranks)", f"load ({W} ranks, fresh staging)"):
        ld = r_of(title)
        if ld is None:
            continue
        extra = paired("raw read (ring)", "load") if title == f"load ({W} ranks)" else ""
        target(f"{title} >= 0.8x raw read", f"{ld['vs_limit']:.2f}x{extra}", ">= 0.80x", ld["vs_limit"] >= 0.8)
        if ld["vs_torch"]:
            target(f"{title} >= 1.2x torch DCP", f"{ld['vs_torch']:.2f}x", ">= 1.20x", ld["vs_torch"] >= 1.2)
    if cw:
        l2 = r_of(f"load {W}->{M} ranks")
        target(f"load {W}->{M} ranks >= 0.8x raw read", f"{l2['vs_limit']:.2f}x", ">= 0.80x", l2["vs_limit"] >= 0.8)
        if l2["vs_torch"]:
            target(
                f"load {W}->{M} ranks >= 1.2x torch DCP", f"{l2['vs_torch']:.2f}x", ">= 1.20x", l2["vs_torch"] >= 1.2
            )
    per_round = sorted(b / m for b, m in zip(ph["save async (blocked)"]["seconds"], res["memcpy"]["prealloc_s"]))
    target(
        "async blocked <= 1.5x memcpy",
        f"{blocked:.3f} s = {blocked / mc:.2f}x memcpy ({mc:.3f} s; per round "
        f"median {median(per_round):.2f}x, {per_round[0]:.2f}-{per_round[-1]:.2f}x)",
        "<= 1.50x",
        blocked <= 1.5 * mc,
        f"memcpy into fresh memory {mcf:.3f} s ({blocked / mcf:.2f}x)",
    )
    worst_save = max(e / b for e, b in zip(save_extra, rank_bytes))
    target(
        "extra RSS save <= 5% of state",
        f"{worst_save:.1%} (max over ranks)",
        "<= 5%",
        worst_save <= 0.05,
        "per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in save_extra),
    )
    worst_load = max(e - b for e, b in zip(load_extra, rank_bytes))
    target(
        f"extra RSS load ({W} ranks) <= slice + chunk",
        f"slice + {worst_load / 2**20:.1f} MiB",
        f"<= slice + {chunk_bound >> 20} MiB",
        worst_load <= chunk_bound,
        "extra per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in load_extra),
    )
    if fresh_extra:
        worst_f = max(e - b for e, b in zip(fresh_extra, rank_bytes))
        target(
            f"extra RSS load ({W} ranks, fresh staging) <= slice + chunk",
            f"slice + {worst_f / 2**20:.1f} MiB",
            f"<= slice + {chunk_bound >> 20} MiB",
            worst_f <= chunk_bound,
            "extra per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in fresh_extra),
        )
    if cw:
        worst2 = max(e - r["slice"] for e, r in zip(cw_extra, cw_slice))
        target(
            f"extra RSS load {W}->{M} <= slice + chunk",
            f"slice + {worst2 / 2**20:.1f} MiB",
            f"<= slice + {chunk_bound >> 20} MiB",
            worst2 <= chunk_bound,
            "extra per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in cw_extra),
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
        f"{W} ranks, changed world {M}, medians of {cfg['repeats']} runs; page cache: "
        f"{res.get('drop_method')}; cached before reads: {_cache_summary(res, cw)}; load average "
        f"{res['loadavg']['start'][0]:.2f} at start, {res['loadavg']['end'][0]:.2f} before the child jobs"
    )
    lines.append("")
    lines.append("| phase | seconds (median, min-max) | GB/s | x raw limit | x torch DCP |")
    lines.append("|---|---|---|---|---|")
    for r in rows:
        sec = r["seconds"]
        name = r["name"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(
            f"| {name} | {r['median_s']:.3f} ({min(sec):.3f}-{max(sec):.3f}) | {r['gbps']:.2f} | "
            f"{_x(r['vs_limit'])} | {_x(r['vs_torch'])} |"
        )
    lines.append(f"| save async, caller blocked | {blocked:.3f} | - | {blocked / mc:.2f}x memcpy | - |")
    first = ph["save async (blocked)"]["seconds"][0]
    lines.append(
        f"| save async, caller blocked, first save (allocates the snapshot buffer) | {first:.3f} | - | "
        f"{first / mc:.2f}x memcpy | - |"
    )
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
    lines.append("| peak RSS over baseline, per rank (MiB) | values | rank state (MiB) |")
    lines.append("|---|---|---|")
    rb = ", ".join(f"{b / 2**20:.0f}" for b in rank_bytes)
    lines.append(f"| save sync | {', '.join(f'{e / 2**20:.1f}' for e in save_extra)} | {rb} |")
    lines.append(f"| save async (snapshot) | {', '.join(f'{e / 2**20:.1f}' for e in async_extra)} | {rb} |")
    lines.append(
        f"| load ({W} ranks, staging in the resident async-save buffer) | "
        f"{', '.join(f'{e / 2**20:.1f}' for e in load_extra)} | {rb} |"
    )
    if fresh_extra:
        lines.append(
            f"| load ({W} ranks, fresh staging) | {', '.join(f'{e / 2**20:.1f}' for e in fresh_extra)} | {rb} |"
        )
    if cw:
        lines.append(
            f"| load {W}->{M} ranks | {', '.join(f'{e / 2**20:.1f}' for e in cw_extra)} | "
            + ", ".join(f"{r['slice'] / 2**20:.0f}" for r in cw_slice)
            + " |"
        )
    if tsame:
        ts_x = [max(r[i]["extra"] for r in tsame["rss_save"]) for i in range(W)]
        tl_x = [max(r[i]["extra"] for r in tsame["rss_load"]) for i in range(W)]
        lines.append(f"| torch DCP save | {', '.join(f'{e / 2**20:.1f}' for e in ts_x)} | {rb} |")
        lines.append(f"| torch DCP load | {', '.join(f'{e / 2**20:.1f}' for e in tl_x)} | {rb} |")
    if "all_gather + paddle.save" in res["rss"]:
        g_x = rss_extra("all_gather + paddle.save")
        lines.append(f"| all_gather + paddle.save | {', '.join(f'{e / 2**20:.1f}' for e in g_x)} | {rb} |")
    lines.append("")
    lines.append("| target | measured | goal | met |")
    lines.append("|---|---|---|---|")
    for t in targets:
        lines.append(f"| {t['target']} | {t['measured']} | {t['goal']} | {'yes' if t['met'] else 'NO'} |")
    lines += _trace_summary(res, cw)
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


def _cache_summary(res, cw) -> str:
    vals = [x for runs in res["cache"].values() for run in runs for x in run if x is not None]
    if cw:
        vals += [x for run in cw["cache"] for x in run if x is not None]
    return f"max {max(vals):.1%} of pages" if vals else "unknown"


def _trace_summary(res, cw) -> list[str]:
    """Median engine phase timings (rank 0 / slowest) from the engine's trace hook."""
    out = []
    groups = dict(res.get("trace", {}))
    if cw and cw.get("trace"):
        groups[f"load {cw['world']} ranks"] = cw["trace"]
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
                f"  {name:>12} | {what} [rank {rank}]: " + " ".join(f"{m}={median(v) * 1000:.0f}" for m, v in d.items())
            )
    return out
