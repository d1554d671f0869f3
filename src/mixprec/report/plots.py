"""The sweep report's plots: report_bars.png (throughput with its spread, and peak memory, one
bar per run, coloured by precision, fp32's value as a reference line), report_curves.png (loss,
loss scale and val accuracy over optimizer steps, each panel with its legend; runs without a
GradScaler have no loss-scale curve) and, where runs measured it (debug.memory),
report_memory.png (each peak as a stacked bar of its parts)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from mixprec.core import files
from mixprec.sinks.local import number as _num

COLOURS = {
    "fp32": "tab:gray",
    "tf32": "tab:brown",
    "amp": "tab:blue",
    "amp_accum": "tab:cyan",
    "bf16": "tab:green",
    "fp8": "tab:purple",
    "fp8_rowwise": "tab:pink",
}


def _bars(ax, runs: list[dict], key: str, title: str, spread: str | None) -> None:
    labels = [r["run"] for r in runs]
    values = [_num(r.get(key)) or 0.0 for r in runs]
    errors = bar_errors(values, [_num(r.get(spread)) for r in runs]) if spread else None
    colours = [COLOURS.get(r.get("precision"), "tab:olive") for r in runs]
    bars = ax.barh(labels, values, color=colours, xerr=errors, capsize=3)
    for bar, r in zip(bars, runs):
        if r.get("status") != "completed":
            bar.set_hatch("//")
            bar.set_edgecolor("tab:red")
    fp32 = [v for r, v in zip(runs, values) if r.get("precision") == "fp32" and v]
    if len(set(fp32)) == 1:  # one fp32 run to compare with: its value as a line
        ax.axvline(fp32[0], color="black", linestyle="--", linewidth=1, label="fp32")
    ax.set_title(title, loc="left", fontsize=10)
    ax.invert_yaxis()


def bar_errors(values: list[float], spreads: list[float | None]) -> list[list[float]]:
    """[below, above] of each bar: the relative spread x the value, never below 0 (a rate is
    not negative: the bar's error stops at the axis)."""
    above = [(sp or 0.0) * v for v, sp in zip(values, spreads)]
    return [[min(e, v) for e, v in zip(above, values)], above]


LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def styles(runs: list[dict]) -> list[tuple[str | None, str, str]]:
    """(colour, line style, marker) of each run: its precision's colour, and within a
    precision a style and a marker of its own (seeds, batch sizes), so no run hides another."""
    seen: dict[str | None, int] = {}
    out = []
    for r in runs:
        i = seen.get(r.get("precision"), 0)
        seen[r.get("precision")] = i + 1
        colour = COLOURS.get(r.get("precision"))
        out.append((colour, LINESTYLES[i % len(LINESTYLES)], MARKERS[i % len(MARKERS)]))
    return out


def png(fig) -> bytes:
    """The figure as PNG bytes (and closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def save(fig, path: Path) -> Path:
    """The figure into `path`, whole or not at all (a full disk keeps the previous image)."""
    return files.write_atomic(path, png(fig))


def draw(runs: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.5 * max(4, len(runs)) + 1.5))
    memory = next((r.get("memory") for r in runs if r.get("memory")), None)
    _bars(
        axes[0],
        runs,
        "samples_per_s",
        "throughput (samples/s; bar: spread over windows)",
        "samples_per_s_spread",
    )
    _bars(axes[1], runs, "peak_mem_gib", f"peak memory (GiB, {memory or 'unknown'})", None)
    shown = sorted({r.get("precision") for r in runs if r.get("precision")})
    handles = [Patch(color=COLOURS.get(p, "tab:olive"), label=p) for p in shown]
    if any(r.get("status") != "completed" for r in runs):
        handles.append(Patch(facecolor="white", edgecolor="tab:red", hatch="//", label="failed"))
    axes[1].legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    paths.append(save(fig, out_dir / "report_bars.png"))

    paths.append(_curves(plt, runs, out_dir))
    measured = [r for r in runs if (r.get("memory_breakdown") or {}).get("peak") is not None]
    if measured:  # debug.memory: the peak's parts, a stacked bar per run
        paths.append(memory_plot(measured, out_dir / "report_memory.png"))
    return paths


TIMED = "@time"  # a panel of a key against training seconds (time/train_s), not steps


def _points(r: dict, key: str) -> list:
    if key == "amp/loss_scale" and r.get("loss_scale") is None:
        return []  # no GradScaler: its logged scale of 1 is not a loss scale
    if key.endswith(TIMED):
        key = key.removesuffix(TIMED)
        return [
            (_num(m.get("time/train_s")), _num(m.get(key)))
            for m in r["curves"]
            if _num(m.get(key)) is not None and _num(m.get("time/train_s")) is not None
        ]
    return [(m["step"], _num(m.get(key))) for m in r["curves"] if _num(m.get(key)) is not None]


def curve_panels(runs: list[dict]) -> list[tuple[str, str]]:
    """(key, title) of each panel report_curves.png draws: none that no run logged."""
    val = "val/acc1" if any(_points(r, "val/acc1") for r in runs) else "val/loss"
    panels = [("train/loss", "train loss")] if any(_points(r, "train/loss") for r in runs) else []
    if any(_points(r, "amp/loss_scale") for r in runs):
        panels.append(("amp/loss_scale", "loss scale (runs with a GradScaler)"))
    if any(_points(r, val) for r in runs) or not panels:  # (one panel at least: it says so)
        panels.append((val, "val top-1" if val == "val/acc1" else "val loss"))
    if any(_points(r, "val/loss" + TIMED) for r in runs):  # what precision buys: time to a loss
        panels.append(("val/loss" + TIMED, "val loss against training seconds"))
    return panels


def _curves(plt, runs: list[dict], out_dir: Path) -> Path:
    """report_curves.png: the panels some run logged (train loss; the loss scale where a
    GradScaler ran; top-1 where there is one, else the validation loss: a language model's),
    each precision in the colour its bars have."""
    panels = curve_panels(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.7 * len(panels), 4.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for r, (colour, line, mark) in zip(runs, styles(runs)):
            pts = _points(r, key)
            if pts:
                ax.plot(
                    *zip(*pts),
                    linestyle=line,
                    marker=mark if len(pts) < 30 else None,
                    markersize=6 if len(pts) < 4 else 4,  # a short run: its points, seen
                    label=r["run"],
                    alpha=0.8,
                    color=colour,
                )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training seconds" if key.endswith(TIMED) else "optimizer step")
        if key == "amp/loss_scale":
            ax.set_yscale("log", base=2)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no run logged one", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return save(fig, out_dir / "report_curves.png")


MEMORY_COLOURS = {
    "weights": "tab:blue",
    "optimizer_state": "tab:orange",
    "inputs_and_buffers": "tab:gray",
    "activations": "tab:green",
    "autocast_copies": "tab:olive",
    "gradients": "tab:red",
    "temporaries": "tab:purple",
    "reserve": "white",
}


def memory_plot(runs: list[dict], path: Path) -> Path:
    """debug.memory: each run's peak as a stacked bar of its parts (GiB), the allocator's
    reserve beside it hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 0.5 * max(4, len(runs)) + 1.5))
    labels = [r["run"] for r in runs]
    left = [0.0] * len(runs)
    for part, colour in MEMORY_COLOURS.items():
        values = [_num(r["memory_breakdown"].get(part)) or 0.0 for r in runs]
        hatch = "//" if part == "reserve" else None
        ax.barh(
            labels,
            values,
            left=left,
            color=colour,
            edgecolor="black",
            linewidth=0.3,
            hatch=hatch,
            label=part.replace("_", " "),
        )
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("GiB at the measured step's peak (debug.memory); hatched: held, unused")
    ax.set_title("where the peak goes", loc="left", fontsize=10)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    fig.tight_layout()
    return save(fig, path)


def loss_scale_plot(run_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pts = [(r["step"], r["amp/loss_scale"]) for r in rows if "amp/loss_scale" in r]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(*zip(*pts))
    ax.set_yscale("log", base=2)
    ax.set(title="loss scale", xlabel="optimizer step")
    fig.tight_layout()
    return save(fig, run_dir / "loss_scale.png")


def study_plot(result: dict) -> bytes:
    """The time-to-quality study (study.py): val loss against training seconds and against
    steps, the mean of each precision over its seeds with their range as a band, the target as
    a dashed line, each seed's fitted curve dotted (smooth=power); and each precision's seconds
    to the target with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mixprec.report.curves import fitted_loss

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    groups: dict[str, list] = {}
    for s in result["seeds"]:
        if not s.diverged and s.curve:
            groups.setdefault(s.precision, []).append(s.curve)
    for precision, curves in groups.items():
        n = min(len(c) for c in curves)  # evaluations at the same steps in every seed
        colour = COLOURS.get(precision, "tab:olive")
        losses = [[c[i].loss for c in curves] for i in range(n)]
        lo, hi = [min(v) for v in losses], [max(v) for v in losses]
        mean = [sum(v) / len(v) for v in losses]
        for ax, xs in (
            (axes[0], [sum(c[i].train_s for c in curves) / len(curves) for i in range(n)]),
            (axes[1], [curves[0][i].step for i in range(n)]),
        ):
            ax.plot(xs, mean, color=colour, label=f"{precision} ({len(curves)} seeds)")
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.2, linewidth=0)
    for s in result["seeds"]:  # smooth=power: each seed's fitted curve, over its window
        if s.fit:
            xs = [s.fit["first"] + i * (s.fit["last"] - s.fit["first"]) / 50 for i in range(51)]
            ys = [fitted_loss(s.fit, x) for x in xs]
            colour = COLOURS.get(s.precision, "tab:olive")
            axes[1].plot(xs, ys, color=colour, linewidth=0.7, linestyle=":")
    # the range past warm-up's transient (the first tenth of the steps), where the target lies
    late = [
        p.loss
        for s in result["seeds"]
        for p in s.curve
        if not s.diverged and p.step >= 0.1 * s.curve[-1].step and math.isfinite(p.loss)
    ]
    for ax, xlabel in ((axes[0], "training seconds"), (axes[1], "optimizer steps")):
        if late and max(late) > min(late):
            pad = 0.08 * (max(late) - min(late))
            ax.set_ylim(min(late) - pad, max(late) + pad)
        ax.axhline(result["target"], color="black", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.legend(fontsize=8)
    _time_to_target(axes[2], result)
    _speedup_by_length(axes[3], result)
    fig.tight_layout()
    return png(fig)


def _speedup_by_length(ax, result: dict) -> None:
    """Each precision's loss-matched speedup at targets along the reference's run, with its
    interval, and its rate ratio (time per step) as a dotted line: where the speedup falls
    below the rate ratio, the precision learns less per step."""
    points = result.get("by_length") or []
    shown = False
    for precision in sorted({r.precision for pt in points for r in pt["rows"]}):
        if precision == result["reference"]:
            continue
        got = [(pt["step"], r) for pt in points for r in pt["rows"] if r.precision == precision]
        got = [(x, r) for x, r in got if r.speedup]
        if not got:
            continue
        colour = COLOURS.get(precision, "tab:olive")
        xs, ys = [x for x, _ in got], [r.speedup for _, r in got]
        lo = [r.speedup - r.interval[0] if r.interval else 0.0 for _, r in got]
        hi = [r.interval[1] - r.speedup if r.interval else 0.0 for _, r in got]
        ax.errorbar(xs, ys, yerr=[lo, hi], color=colour, marker="o", capsize=3, label=precision)
        rates = [r.rate_ratio for _, r in got if r.rate_ratio]
        if rates:
            ax.axhline(rates[-1], color=colour, linestyle=":", linewidth=1)
        shown = True
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"reference step of the target ({result['reference']})")
    ax.set_ylabel("loss-matched speedup")
    ax.set_title("speedup against length (dotted: rate ratio)", fontsize=10)
    if shown:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no precision to compare", ha="center", transform=ax.transAxes)


def _time_to_target(ax, result: dict) -> None:
    """Each precision's training seconds to the target: the reference ± its seeds' std, the
    others with their speedup's interval as seconds; a bar over fewer seeds says so."""
    rows = [r for r in result["rows"] if r.seconds_to]
    names = [r.precision for r in rows]
    means = [r.seconds_to[0] for r in rows]
    ref = next((r.seconds_to[0] for r in rows if r.precision == result["reference"]), None)
    # the reference: its seeds' std; the others: the speedup's interval as seconds (the
    # reference's mean time over the interval's bounds)
    # (the bar is the mean time, the interval is on the geometric-mean speedup: with a tight
    # interval the two can disagree by more than its width, and an error bar is never negative)
    err = [
        [max(0.0, m - ref / r.interval[1]), max(0.0, ref / r.interval[0] - m)]
        if r.interval and ref
        else [r.seconds_to[1], r.seconds_to[1]]
        for r, m in zip(rows, means)
    ]
    ax.barh(
        names,
        means,
        xerr=list(zip(*err)) if err else None,
        color=[COLOURS.get(n, "tab:olive") for n in names],
        capsize=4,
    )
    for i, r in enumerate(rows):  # a bar over fewer seeds than ran says so
        reached = r.seeds - len(r.not_reached) - len(r.diverged)
        if reached < r.seeds:
            ax.annotate(
                f"{reached} of {r.seeds} seeds reached it",
                (0, i),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                color="white",
                fontsize=8,
            )
    ax.invert_yaxis()
    ax.set_xlabel(f"training seconds to val loss {result['target']:.3f}")
    ax.set_title(
        f"{result['reference']}: ± std over seeds; others: {int(result['level'] * 100)} % "
        "interval of the speedup, as seconds",
        loc="left",
        fontsize=9,
    )
