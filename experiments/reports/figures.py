"""The report's figures (matplotlib), each with the hardware and, for throughput, the FLOPs
convention in its title; the paper's points are drawn beside ours and marked APPROX when they
were read from a figure. Used by report.py and notebooks/figures.ipynb."""
from __future__ import annotations

import math
import textwrap

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "zero-repro"  # stable element ids: regenerated SVGs diff cleanly
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from experiments.analysis.memory import model_state_bytes  # noqa: E402

from .comm_claims import counted, tests_the_claim  # noqa: E402
from .tables import STAGE_NAMES, paper_throughput  # noqa: E402

FLOPS_NOTE = "model FLOPs: Narayanan et al. Eq. 3, c = 4 with recomputation, 3 without"
STAGE_COLORS = {"baseline DP": "tab:gray", "Pos": "tab:blue", "Pos+g": "tab:orange", "Pos+g+p": "tab:green"}
KIND_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer_states": "tab:green"}


def _ok(records: list[dict]) -> list[dict]:
    """ok records measured on hardware (simulated ones have their own figure, simulated_memory)."""
    return [r for r in records if r["status"] == "ok" and r.get("measured_by") != "simulated"]


def _main_experiment(ok: list[dict]) -> list[dict]:
    """The ok records of the experiment with the most model sizes (then the most records):
    one recipe, one precision, so its points compare."""
    if not ok:
        return []
    by_exp: dict[str, list[dict]] = {}
    for r in ok:
        by_exp.setdefault(r["experiment"], []).append(r)
    best = max(by_exp.values(), key=lambda rs: (len({r["params"] for r in rs}), len(rs)))
    return best


def _scale(params: list[float]) -> tuple[float, str]:
    return (1e9, "B") if max(params, default=0) >= 1e9 else (1e6, "M")


def hardware_label(records: list[dict]) -> str:
    labels = sorted({_hw(r) for r in records})
    return "; ".join(labels) if labels else "no records"


def _hw(r: dict) -> str:
    hw = r.get("hardware", {})
    return f"{hw.get('gpu_count')} x {hw['gpu']}" if hw.get("gpu") else f"CPU {hw.get('cpu', '?')}, gloo"


def _subplots(*grid: int, **kwargs) -> tuple[Figure, object]:
    """plt.subplots with constrained layout: the suptitle, panel titles, tick labels and legends outside
    the axes get their own space at any dpi (a tight_layout afterwards would overlap them again)."""
    return plt.subplots(*grid, layout="constrained", **kwargs)


def _two_panels(title: str, records: list[dict]) -> tuple[Figure, tuple]:
    fig, axes = _subplots(1, 2, figsize=(12, 4.6))
    fig.suptitle(f"{title}\nmeasured on: {hardware_label(records)}", fontsize=10)
    return fig, axes


def _finish(*axes) -> None:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)


EMPTY_PANEL = "empty"  # the gid of a panel _empty drew: has_empty_panel finds it


def _empty(ax, text: str) -> None:
    """A panel with nothing to draw: its title and why, wrapped to fit, without an axis of made-up 0-1 ranges."""
    ax.set_axis_off()
    ax.set_gid(EMPTY_PANEL)
    ax.text(0.5, 0.5, textwrap.fill(text, 44), ha="center", va="center", transform=ax.transAxes, fontsize=9,
            color="0.4")


def has_empty_panel(fig: Figure) -> bool:
    """Whether a panel of the figure had none of its records to draw (a per-experiment report skips it)."""
    return any(ax.get_gid() == EMPTY_PANEL for ax in fig.axes)


def _headroom(ax, room: float = 0.12) -> None:
    """The y range from zero to the largest value drawn (bars, lines, marks: matplotlib's data limits)
    plus `room` of it, for the labels written above bars and lines. Never a fixed range: a value
    above it would run off the top unseen."""
    top = ax.dataLim.y1
    if math.isfinite(top) and top > 0:
        ax.set_ylim(0, top * (1 + room))


def _tick_label(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _log_axis(axis, values, base: int = 10, room: float = 1.25) -> None:
    """A log axis spanning the data (a factor `room` beyond each end) with major ticks at 1-2-5 steps
    (powers of two for base 2) inside it, short plain labels, and no minor labels: matplotlib's own
    labels a narrow range's minor ticks (2x10^-1, 3x10^-1, ...) until they collide."""
    ax = axis.axes
    positive = [float(v) for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        return
    lo, hi = min(positive) / room, max(positive) * room
    first, last = math.floor(math.log(lo, base)), math.ceil(math.log(hi, base))
    steps = (1,) if base != 10 or last - first > 4 else (1, 2, 5)
    ticks = [m * base ** k for k in range(first, last + 1) for m in steps if lo <= m * base ** k <= hi]
    if len(ticks) < 2:  # a range narrower than one step: label the data's own values, 2 digits
        ticks = sorted({float(f"{v:.2g}") for v in (min(positive), max(positive))})
    if axis is ax.xaxis:
        ax.set_xscale("log", base=base)
        ax.set_xlim(lo, hi)
    else:
        ax.set_yscale("log", base=base)
        ax.set_ylim(lo, hi)
    axis.set_ticks(ticks, [_tick_label(t) for t in ticks])
    axis.set_minor_locator(NullLocator())


def throughput_vs_size(records: list[dict], paper: pd.DataFrame | None = None) -> Figure:
    """Figure 2 style: TFLOPs/GPU against model size, per stage (baseline DP against ZeRO)."""
    paper = paper_throughput() if paper is None else paper
    fig, (ours, theirs) = _two_panels(f"Throughput vs model size ({FLOPS_NOTE})", records)
    main = _main_experiment(_ok(records))
    gpus = max((r["world_size"] for r in main), default=0)
    chosen = [r for r in main if r["world_size"] == gpus]  # Figure 2 compares at one GPU count
    unit, letter = _scale([r["params"] for r in chosen])
    for stage in sorted({r["stage"] for r in chosen}):
        pts = sorted((r["params"], r["tflops_per_gpu"]) for r in chosen if r["stage"] == stage)
        name = STAGE_NAMES[stage]
        ours.plot([p / unit for p, _ in pts], [t for _, t in pts], "o-", color=STAGE_COLORS[name], label=name)
    if not chosen:
        _empty(ours, "no ok records selected")
    title = f"this suite: {chosen[0]['experiment']}, {gpus} ranks" if chosen else "this suite"
    _log_axis(ours.xaxis, [r["params"] / unit for r in chosen])
    ours.set(xlabel=f"parameters ({letter})", ylabel="TFLOPs / GPU", title=title)
    for series, marker in (("ZeRO", "s-"), ("Baseline", "^-")):
        p = paper[(paper.experiment == "fig2") & (paper.series == series) & paper.exactness.str.startswith("APPROX")]
        theirs.plot([float(x[:-1]) for x in p.x], p.paper_tflops_per_gpu, marker, label=f"{series}, DeepSpeed figure (APPROX)")
    theirs.set(xlabel="parameters (B)", ylabel="TFLOPs / GPU", title="DeepSpeed's ZeRO-2 figure (pixels): 400 V100")
    _finish(ours, theirs)
    return fig


def scaling(records: list[dict], paper: pd.DataFrame | None = None) -> Figure:
    """Figure 3 style: TFLOPs/GPU against GPU count, per model and stage."""
    paper = paper_throughput() if paper is None else paper
    fig, (ours, theirs) = _two_panels(f"Scaling with GPU count ({FLOPS_NOTE})", records)
    main = _main_experiment(_ok(records))
    largest = max(main, key=lambda r: r["params"])["model"]["name"] if main else None
    for (model, stage) in sorted({(r["model"]["name"], r["stage"]) for r in main}):
        pts = sorted((r["world_size"], r["tflops_per_gpu"]) for r in main if r["model"]["name"] == model and r["stage"] == stage)
        if len(pts) > 1:  # the largest model in full colour, the others faint
            ours.plot(*zip(*pts), "o-", label=f"{model} {STAGE_NAMES[stage]}", color=STAGE_COLORS[STAGE_NAMES[stage]],
                      alpha=1.0 if model == largest else 0.3)
    if main:
        ours.set_xticks(sorted({r["world_size"] for r in main}))
    else:
        _empty(ours, "no ok records selected")
    ours.set(xlabel="GPUs (ranks)", ylabel="TFLOPs / GPU", title=f"this suite: {main[0]['experiment']}" if main else "this suite")
    if main:  # a dozen lines: their legend goes under the axes, where it covers none of them
        _legend_below(ours, ncol=4)
    p = paper[paper.experiment == "fig3"]
    theirs.plot([int(x.split()[0]) for x in p.x], p.paper_tflops_per_gpu, "s-", label="60B, ZeRO, DeepSpeed figure (APPROX)")
    theirs.set(xlabel="GPUs", ylabel="TFLOPs / GPU", title="DeepSpeed's ZeRO-2 figure (pixels): 60B, MP 16")
    _finish(theirs)
    ours.grid(alpha=0.3)
    return fig


def largest_model(records: list[dict]) -> Figure:
    """Figure 4 and Table 2: the largest model each stage fits, simulated at the paper's world size
    (the searches of simulate_largest=true) beside the paper's number in the same panel."""
    from .tables import largest_table
    largest = largest_table(records)
    fig, (fig4, t2) = _subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [2, 3]})
    fig.suptitle("Largest model that fits a 32 GB V100: the paper beside SIMULATED maxima at the paper's world size\n"
                 "(one rank on fake tensors, peak + 1 GB CUDA reserve <= 32 GB; fragmentation, NCCL buffers and "
                 "kernel workspaces not seen)", fontsize=9)
    rows = largest[largest.experiment == "fig4"]
    stages = [s for s in ("baseline DP", "Pos+g") if s in set(rows.stage)]
    for i, stage in enumerate(stages):
        row = rows[rows.stage == stage].iloc[0]
        for dx, value, style, label in ((-0.2, _billions(row.paper), {"color": "none", "hatch": "//"}, "paper"),
                                        (0.2, row.simulated_max_B, {}, "simulated")):
            bar = fig4.bar(i + dx, value, 0.4, edgecolor=STAGE_COLORS[stage], color=style.get("color", STAGE_COLORS[stage]),
                           hatch=style.get("hatch"), label=f"{label}" if i == 0 else None)
            fig4.annotate(f"{value:.3g}B", (i + dx, bar[0].get_height()), ha="center", va="bottom", fontsize=8)
    if stages:
        fig4.set_xticks(range(len(stages)), [f"{s}\nmicro-batch {rows[rows.stage == s].micro_batch.iloc[0]}"
                                              for s in stages])
        fig4.legend(fontsize=8, loc="upper left")
        _headroom(fig4, 0.15)
    else:
        _empty(fig4, "no simulated searches of experiment=fig4 (simulate_largest=true)")
    fig4.set(ylabel="parameters (B)", title="Figure 4: 128 V100, no model parallelism")
    rows = largest[largest.experiment == "table2"]
    for stage, step in (("baseline DP", "whole"), ("Pos", "chunked")):
        sel = rows[(rows.stage == stage) & (rows.optimizer_step == step)].sort_values("mp")
        if len(sel):
            color = STAGE_COLORS[stage]
            t2.plot(sel.mp, sel.simulated_max_B, "o-", color=color, label=f"{stage}, simulated")
            t2.plot(sel.mp, [_billions(p) for p in sel.paper], "s--", mfc="none", color=color,
                    label=f"{stage}, paper (measured)")
    if len(rows):
        drawn = [v for line in t2.get_lines() for v in line.get_ydata()]
        _log_axis(t2.yaxis, drawn)
        mps = sorted({int(m) for m in rows.mp})
        t2.set_xscale("log", base=2)
        t2.set_xticks(mps, [str(m) for m in mps])
        t2.xaxis.set_minor_locator(NullLocator())
        t2.legend(fontsize=8)
    else:
        _empty(t2, "no simulated searches of experiment=table2 (simulate_largest=true)")
    t2.set(xlabel="MP degree (GPUs = 64 x MP)", ylabel="parameters (B)", title="Table 2: Nd = 64, micro-batch 1; baseline with a whole-model optimizer step")
    for ax in (fig4, t2):
        ax.grid(alpha=0.3, axis="y")
    return fig


def _billions(printed: str) -> float:
    """The paper's size in a largest-table cell ("13B (Sec 10.4)", "1.3B") in billions."""
    return float(printed.split("B")[0])


V100_BYTES = 32e9  # the paper's device (a 32 GB V100): the budget largest_model_cpu divides


def largest_model_cpu(records: list[dict]) -> Figure:
    """The CPU grid read as the paper reads its Figure 4 and Table 2: the largest model whose model
    states would fit a 32 GB V100, from the model-state bytes per parameter each stage measured at
    each DP degree (the grid's largest model, TP 1). Every stage trains every model of the grid on
    this machine, so the grid itself has no limit to show; its bytes per parameter are what set one."""
    ok = [r for r in _ok(records) if r["tp"] == 1 and r["memory"]["measured"].get("total")]
    main = _main_experiment(ok)
    model = max(main, key=lambda r: r["params"])["model"]["name"] if main else None
    chosen = [r for r in main if r["model"]["name"] == model]
    fig, ax = _subplots(figsize=(8, 4.8))
    what = f"{model}, {chosen[0]['precision']}; " if chosen else ""
    fig.suptitle("CPU grid: the largest model whose model states would fit a 32 GB V100, at the bytes per "
                 f"parameter measured here\n({what}activations, buffers and the CUDA reserve not counted; "
                 f"measured on: {hardware_label(chosen)})", fontsize=9)
    if not chosen:
        _empty(ax, "no ok records at TP 1 with measured model states")
        return fig
    dps = sorted({r["dp"] for r in chosen})
    stages = sorted({r["stage"] for r in chosen})
    width = 0.8 / len(stages)
    for i, stage in enumerate(stages):
        by_dp = {r["dp"]: r for r in chosen if r["stage"] == stage}
        xs = [j + (i - (len(stages) - 1) / 2) * width for j, dp in enumerate(dps) if dp in by_dp]
        per_param = [by_dp[dp]["memory"]["measured"]["total"] / by_dp[dp]["params"] for dp in dps if dp in by_dp]
        name = STAGE_NAMES[stage]
        bars = ax.bar(xs, [V100_BYTES / b / 1e9 for b in per_param], width, color=STAGE_COLORS[name], label=name)
        for bar, b in zip(bars, per_param):  # the measured quantity itself, under the number it gives
            ax.annotate(f"{b:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(dps)), [f"Nd = {dp}" for dp in dps])
    ax.set(ylabel="parameters (B) in 32 GB", xlabel="DP degree (ranks); above each bar: measured bytes per parameter")
    _headroom(ax, 0.12)
    _legend_below(ax, ncol=len(stages))
    ax.grid(alpha=0.3, axis="y")
    return fig


def memory_bars(records: list[dict], psi: float = 7.5e9, nds: tuple[int, ...] = (1, 4, 16, 64)) -> Figure:
    """Stacked model-state bars per stage and Nd: the paper's 16Ψ shrinking to 16Ψ/Nd (its
    Figure 1 example, 7.5B), and the suite's measured bytes beside their prediction."""
    fig, (theory, measured) = _two_panels("Model-state memory per device by stage and DP degree", records)
    bars = [(STAGE_NAMES[stage], nd, model_state_bytes(psi, stage, nd)) for stage in range(4) for nd in nds]
    _stack(theory, [(stage, nd) for stage, nd, _ in bars], [{k: b[k] / 1e9 for k in KIND_COLORS} for *_, b in bars])
    theory.set(ylabel="GB", title=f"memory model, Ψ = {psi / 1e9:g}B, K = 12 (Table 1)")
    ok = [r for r in _ok(records) if r["tp"] == 1]
    pool = [r for r in ok if r["experiment"] == "table1"] or _main_experiment(ok)  # table1 measures exactly this
    model = max(pool, key=lambda r: r["params"])["model"]["name"] if pool else None
    chosen = sorted((r for r in pool if r["model"]["name"] == model), key=lambda r: (r["stage"], r["dp"]))
    if chosen:
        _stack(measured, [(STAGE_NAMES[r["stage"]], r["dp"]) for r in chosen],
               [{k: r["memory"]["measured"][k] / 1e6 for k in KIND_COLORS} for r in chosen])
        measured.plot(range(len(chosen)), [r["memory"]["predicted"]["total"] / 1e6 for r in chosen], "k_", ms=18,
                      label="predicted total")
        measured.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        _empty(measured, "no ok records selected")
    measured.set(ylabel="MB", title=f"measured, rank 0: {chosen[0]['experiment']}, {model}, {chosen[0]['precision']}"
                 if chosen else "measured")
    return fig


def _stack(ax, bars: list[tuple[str, int]], values: list[dict[str, float]]) -> None:
    """Stacked bars, one per (stage, Nd): Nd under each bar and the stage once under its group, both
    horizontal and large enough to read at the notebook's 90 dpi (a rotated label per bar was not)."""
    bottom = [0.0] * len(bars)
    for kind, color in KIND_COLORS.items():
        heights = [v[kind] for v in values]
        ax.bar(range(len(bars)), heights, bottom=bottom, color=color, label=kind.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(bars)), [str(nd) for _, nd in bars], fontsize=8)
    ax.set_xlabel("Nd (DP degree), by stage", fontsize=8, labelpad=18)
    groups: dict[str, list[int]] = {}
    for i, (stage, _) in enumerate(bars):
        groups.setdefault(stage, []).append(i)
    stages = ax.secondary_xaxis("bottom")  # a second row of labels under the Nd ticks: the stage of each group
    stages.set_xticks([sum(p) / len(p) for p in groups.values()], list(groups), fontsize=8)
    stages.tick_params(length=0, pad=14)
    for positions in list(groups.values())[1:]:  # a faint line between groups
        ax.axvline(positions[0] - 0.5, color="0.7", lw=0.8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them


def communication(records: list[dict]) -> Figure:
    """Elements moved per step, in units of Ψ, per stage: measured against the paper's 2Ψ / 3Ψ and
    against the engine's own formula for each record (stage 3: 3Ψ less the root unit's second gather
    that stage3_keep_root saves). The records are the claims' (reports/comm_claims.py): at DP > 1,
    stages 2-3 with one micro-batch a step."""
    fig, (ax, detail) = _two_panels("Communication per training step (elements handed to torch.distributed)", records)
    by_stage, left_out = counted(_ok(records), simulated=False)
    ok = [r for r in _ok(records) if r["dp"] > 1 and r["params_per_gpu"] and tests_the_claim(r)]
    ax.set_title("measured (dots) vs the paper's 2Ψ, 2Ψ, 2Ψ, 3Ψ (bars)")
    detail.set_title("per record" + (f" ({sum(left_out.values())} accumulating micro-batches left out)"
                                     if left_out else ""))
    if not ok:
        for panel in (ax, detail):
            _empty(panel, "no ok records with DP > 1 that count a step as Sec 7 does")
        return fig
    for stage, c in sorted(by_stage.items()):
        color = STAGE_COLORS[STAGE_NAMES[stage]]
        ax.scatter([stage] * len(c.per_psi), c.per_psi, color=color, zorder=3)
        if c.root_kept and max(c.root_kept) > 0:  # the engine's formula for each record, where it is not 3Ψ
            ax.scatter([stage] * len(c.root_kept), [3 - k for k in c.root_kept], marker="_", s=300, color="0.3",
                       zorder=2, label="3Ψ less the root's second gather")
    for stage in range(4):
        ax.hlines(3 if stage == 3 else 2, stage - 0.3, stage + 0.3, color="k", lw=2)
        pts = sorted((r["dp"], r["comm"]["elements_per_step"]) for r in ok if r["stage"] == stage)
        if pts:
            detail.plot(*zip(*pts), "o", color=STAGE_COLORS[STAGE_NAMES[stage]], label=STAGE_NAMES[stage])
    ax.set_xticks(range(4), [STAGE_NAMES[s] for s in range(4)])
    ax.set(ylabel="elements per step / Ψ")
    if any(max(c.root_kept, default=0) > 0 for c in by_stage.values()):
        ax.set_title("measured (dots) vs the paper's 2Ψ, 2Ψ, 2Ψ, 3Ψ (bars); Pos+g+p under 3Ψ:\n"
                     "by default the engine gathers the root unit once a step\n"
                     "(stage3_keep_root); zero.stage3_keep_root=false moves 3Ψ", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    _headroom(ax, 0.15)
    _log_axis(detail.yaxis, [r["comm"]["elements_per_step"] for r in ok])
    detail.set_xticks(sorted({r["dp"] for r in ok}))
    detail.set(xlabel="DP degree", ylabel="elements per step")
    detail.legend(fontsize=8)
    return fig


# -- the paper's Figures 2, 3, 4 and 8: the step-time model's prediction in the paper's panel ----
MODEL_NOTE = ("predicted: experiments/analysis/step_time.py on dgx2_v100 (no constant fitted to the paper); "
              "APPROX: DeepSpeed's ZeRO-2 figure read from pixels, not the paper's numbers")
ZERO_COLOR, BASE_COLOR, TEXT_COLOR = "tab:orange", "tab:gray", "tab:red"


def _legend_below(ax, ncol: int = 3) -> None:
    """Legend under the axes, where it cannot cover data."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, fontsize=7, frameon=False)


def fig2_predicted(records: list[dict]) -> Figure:
    """Figure 2: TFLOPs/GPU against model size, ZeRO-100B and the Megatron baseline, predicted
    beside DeepSpeed's figure readings and the text's numbers; ZeRO/baseline speedup."""
    from .predictions import predicted_rows
    rows = [r for r in predicted_rows(records) if r["figure"] == "fig2"]
    fig, (ax, sp) = _subplots(1, 2, figsize=(12.5, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    fig.suptitle(f"Figure 2: throughput vs model size, 400 V100 (baselines 384/256)\n{MODEL_NOTE}", fontsize=9)
    labels = [r["model"] for r in rows if r["series"] == "ZeRO"]
    pos = {m: i for i, m in enumerate(labels)}
    for series, color, style in (("ZeRO", ZERO_COLOR, "-"), ("Baseline", BASE_COLOR, "--")):
        sel = [r for r in rows if r["series"] == series]
        name = "ZeRO-100B" if series == "ZeRO" else "Megatron-LM baseline"
        ax.plot([pos[r["model"]] for r in sel], [r["predicted"] for r in sel], "o" + style, color=color,
                label=f"{name}, predicted")
        read = [r for r in sel if r["ds_figure_APPROX"] is not None]
        ax.plot([pos[r["model"]] for r in read], [r["ds_figure_APPROX"] for r in read], "s" if series == "ZeRO" else "^",
                mfc="none", color=color, ms=8, ls="none", label=f"{name}, DeepSpeed figure (APPROX)")
        for r in sel:
            if r["paper_text_value"] is not None:
                ax.plot(pos[r["model"]], r["paper_text_value"], "D", color=TEXT_COLOR, ms=6, ls="none",
                        label="paper text" if series == "ZeRO" else None)
                ax.annotate(f"text: {r['paper_text']}", (pos[r["model"]], r["paper_text_value"]), xytext=(6, 4),
                            textcoords="offset points", fontsize=7, color=TEXT_COLOR)
    meas = [r for r in rows if r["measured"] is not None]
    if meas:
        ax.plot([pos[r["model"]] for r in meas], [r["measured"] for r in meas], "*", color="k", ms=11, ls="none",
                label="measured (this suite)")
    ax.set_xticks(range(len(labels)), labels)
    ax.set(xlabel="model size (parameters)", ylabel="TFLOPs / GPU", title="per-GPU throughput")
    _headroom(ax, 0.1)
    ax.grid(alpha=0.3)
    _legend_below(ax)
    zero = [r for r in rows if r["series"] == "ZeRO" and r["speedup_predicted"]]
    xs = range(len(zero))
    sp.bar([i - 0.2 for i in xs], [r["speedup_predicted"] for r in zero], 0.4, color=ZERO_COLOR, label="predicted")
    sp.bar([i + 0.2 for i in xs], [r["speedup_ds_figure_APPROX"] or 0 for r in zero], 0.4, color="none",
           edgecolor=ZERO_COLOR, hatch="//", label="DeepSpeed figure (APPROX)")
    sp.axhline(10, color=TEXT_COLOR, ls=":", lw=1.2, label="paper text: up to 10x")
    sp.set_xticks(list(xs), [r["model"] for r in zero], fontsize=8)
    sp.set(ylabel="ZeRO-100B / baseline (per GPU)", title="speedup over the baseline")
    _log_axis(sp.yaxis, [r["speedup_predicted"] for r in zero] + [r["speedup_ds_figure_APPROX"] for r in zero]
              + [1, 10])  # parity and the paper's 10x in range
    sp.grid(alpha=0.3, which="both", axis="y")
    _legend_below(sp, ncol=2)
    return fig


def fig3_predicted(records: list[dict]) -> Figure:
    """Figure 3: the 60B model from 64 to 400 GPUs: aggregate throughput against the perfect-linear
    line through the 64-GPU point (above it = superlinear), and per GPU."""
    from .predictions import figure_readings, predicted_rows
    rows = sorted((r for r in predicted_rows(records) if r["figure"] == "fig3"), key=lambda r: r["gpus"])
    readings = figure_readings()
    fig, (agg, per) = _subplots(1, 2, figsize=(12.5, 5.2))
    fig.suptitle(f"Figure 3: 60B model, MP 16, batch per replica 16/48/48/64 (Table 6)\n{MODEL_NOTE}", fontsize=9)
    gpus = [r["gpus"] for r in rows]
    pred_total = [r["predicted"] * r["gpus"] / 1000 for r in rows]
    paper_total = [readings.get(("fig3", "total", f"{g} GPUs")) for g in gpus]
    agg.plot(gpus, pred_total, "o-", color=ZERO_COLOR, label="predicted")
    agg.plot(gpus, [pred_total[0] * g / gpus[0] for g in gpus], ":", color=ZERO_COLOR, label="predicted, perfect linear")
    if all(v is not None for v in paper_total):
        agg.plot(gpus, [v / 1000 for v in paper_total], "s-", mfc="none", color="tab:blue",
                 label="DeepSpeed figure (APPROX)")
        agg.plot(gpus, [paper_total[0] / 1000 * g / gpus[0] for g in gpus], ":", color="tab:blue",
                 label="figure, perfect linear")
    meas = [r for r in rows if r["measured"] is not None]
    if meas:
        agg.plot([r["gpus"] for r in meas], [r["measured"] * r["gpus"] / 1000 for r in meas], "*", color="k", ms=11,
                 ls="none", label="measured (this suite)")
    agg.set_xscale("log", base=2)
    agg.set_xticks(gpus, [str(g) for g in gpus])
    agg.xaxis.set_minor_locator(NullLocator())
    _log_axis(agg.yaxis, [v for line in agg.get_lines() for v in line.get_ydata()], base=2)
    agg.set(xlabel="GPUs", ylabel="aggregate PFLOPs", title="aggregate: above its dotted line = superlinear")
    agg.grid(alpha=0.3)
    _legend_below(agg, ncol=2)
    xs = range(len(rows))
    per.bar([i - 0.2 for i in xs], [r["predicted"] for r in rows], 0.4, color=ZERO_COLOR, label="predicted")
    per.bar([i + 0.2 for i in xs], [r["ds_figure_APPROX"] or 0 for r in rows], 0.4, color="none",
            edgecolor="tab:blue", hatch="//", label="DeepSpeed figure (APPROX)")
    per.set_xticks(list(xs), [str(g) for g in gpus])
    per.set(xlabel="GPUs", ylabel="TFLOPs / GPU", title="per GPU")
    per.grid(alpha=0.3, axis="y")
    _legend_below(per, ncol=2)
    return fig


def fig4_predicted(records: list[dict]) -> Figure:
    """Figure 4: data parallelism only (MP 1, 128 GPUs): ZeRO-100B up to 13B against PyTorch DDP."""
    from .predictions import predicted_rows
    rows = [r for r in predicted_rows(records) if r["figure"] == "fig4"]
    fig, ax = _subplots(figsize=(12.5, 5.2))
    fig.suptitle(f"Figure 4: no model parallelism, 128 V100 (Table 10)\n{MODEL_NOTE}", fontsize=9)
    xs = range(len(rows))
    colors = [ZERO_COLOR if r["series"] == "ZeRO" else BASE_COLOR for r in rows]
    ax.bar([i - 0.2 for i in xs], [r["predicted"] for r in rows], 0.4, color=colors, label="predicted")
    ax.bar([i + 0.2 for i in xs], [r["ds_figure_APPROX"] or 0 for r in rows], 0.4, color="none", edgecolor=colors,
           hatch="//", label="DeepSpeed figure (APPROX)")
    zero = [i for i, r in enumerate(rows) if r["series"] == "ZeRO"]
    ax.hlines(40, min(zero) - 0.4, max(zero) + 0.4, color=TEXT_COLOR, ls=":", label="paper text: over 40 on average (ZeRO)")
    avg = sum(rows[i]["predicted"] for i in zero) / len(zero)
    ax.hlines(avg, min(zero) - 0.4, max(zero) + 0.4, color=ZERO_COLOR, ls="--", label=f"predicted average {avg:.1f}")
    for i, r in enumerate(rows):
        if r["paper_text_value"] is not None:
            ax.plot(i, r["paper_text_value"], "v", color=TEXT_COLOR, ms=7, ls="none", label=f"paper text: {r['paper_text']}")
        if r["measured"] is not None:
            ax.plot(i, r["measured"], "*", color="k", ms=11, ls="none")
    ax.set_xticks(list(xs), [f"{r['model']}\n{'ZeRO' if r['series'] == 'ZeRO' else 'DDP'}" for r in rows], fontsize=8)
    ax.set(ylabel="TFLOPs / GPU", title="per-GPU throughput (ZeRO-100B orange, PyTorch DDP grey)")
    _headroom(ax, 0.08)
    ax.grid(alpha=0.3, axis="y")
    _legend_below(ax, ncol=5)
    return fig


BREAKDOWN = (("compute_gemm_s", "GEMMs", "tab:blue"), ("compute_memory_bound_s", "memory-bound kernels", "tab:cyan"),
             ("kernel_floors_s", "kernel floors", "tab:gray"), ("tp_comm_s", "TP all-reduces", "tab:purple"),
             ("dp_comm_exposed_s", "DP (exposed)", "tab:green"), ("pa_s", "Pa all-gathers", "tab:olive"),
             ("offload_s", "Pa+cpu PCIe", "tab:brown"), ("optimizer_s", "optimizer", "tab:pink"))


def fig8_predicted(records: list[dict]) -> Figure:
    """Figure 8: throughput per ZeRO-R configuration (60B on 128 GPUs, 170B on 400), predicted,
    and where each step's time goes. The paper prints no number for this figure."""
    from .predictions import predicted_rows
    rows = [r for r in predicted_rows(records) if r["figure"] == "fig8"]
    fig, (ax, br) = _subplots(1, 2, figsize=(12.5, 5.2))
    fig.suptitle("Figure 8: throughput per ZeRO configuration (Table 9; C1-C5 mapping inferred, results/paper)\n"
                 "predicted: experiments/analysis/step_time.py on dgx2_v100; the paper prints no numbers for "
                 "this figure (its text: C5 slower than C4 at 60B; 170B needs C5)", fontsize=9)
    names = [f"{r['model']} {r['zero_r']}\nbatch {r['micro_batch']}" for r in rows]
    xs = range(len(rows))
    ax.bar(list(xs), [r["predicted"] for r in rows], 0.6, color=ZERO_COLOR, label="predicted")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['predicted']:.1f}", (i, r["predicted"]), ha="center", va="bottom", fontsize=8)
        if r["measured"] is not None:
            ax.plot(i, r["measured"], "*", color="k", ms=11, ls="none")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set(ylabel="TFLOPs / GPU", title="per-GPU throughput")
    _headroom(ax, 0.1)
    ax.grid(alpha=0.3, axis="y")
    _legend_below(ax, ncol=1)
    bottom = [0.0] * len(rows)
    for key, label, color in BREAKDOWN:
        share = [r[key] / r["step_s"] for r in rows]
        br.bar(list(xs), share, 0.6, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, share)]
    br.set_xticks(list(xs), names, fontsize=8)
    br.set(ylabel="share of the predicted step", title="where a step goes")
    _headroom(br, 0.0)  # the shares sum to the step; a breakdown over it would show
    _legend_below(br, ncol=3)
    return fig


SIM_KINDS = {"params": "tab:blue", "grads": "tab:orange", "optimizer_states": "tab:green",
             "activations": "tab:red", "buffers": "tab:purple", "gathered_params": "tab:pink",
             "temporaries": "tab:gray"}


def simulated_memory(records: list[dict]) -> Figure:
    """Simulated points (experiments/run/fake.py): the simulated rank's tensors at their peak by kind
    (bars), the caching allocator's reserved peak replayed from the same allocations (a tick: the
    tensors plus what the allocator cached and split), against the device (line) less the cluster's
    CUDA reserve (dashed), one panel per experiment (the two with the most simulated points), one
    above the other so each label is readable; marked SIMULATED, never mixed with hardware."""
    sims = [r for r in records if r.get("measured_by") == "simulated" and "peak_by_kind" in r.get("memory", {})]
    by_exp: dict[str, list[dict]] = {}
    for r in sims:
        by_exp.setdefault(r["experiment"], []).append(r)
    chosen = sorted(by_exp, key=lambda e: -len(by_exp[e]))[:2]
    fig, axes = _subplots(max(1, len(chosen)), 1, figsize=(13, 5.2 * max(1, len(chosen))), squeeze=False)
    fig.suptitle("SIMULATED device memory of one rank at the point's full world size (fake tensors, CUDA 512-byte "
                 "blocks). Bars: the tensors at their peak; tick: the caching allocator's reserved peak, replayed\n"
                 "from the same allocations (fragmentation included). A point is oom when that reserved peak plus "
                 "the CUDA reserve exceeds the device. Not seen: NCCL's buffers, kernel workspaces but cuBLAS's.",
                 fontsize=9)
    if not chosen:
        _empty(axes[0][0], "no simulated records")
    for ax, experiment in zip(axes[:, 0], chosen):
        rs = sorted(by_exp[experiment], key=lambda r: (r["stage"] == 0, r["params"]))
        labels = [_simulated_label(r) for r in rs]
        bottom = [0.0] * len(rs)
        for kind, color in SIM_KINDS.items():
            heights = [r["memory"]["peak_by_kind"].get(kind, 0) / 1e9 for r in rs]
            ax.bar(range(len(rs)), heights, bottom=bottom, color=color, label=kind.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights)]
        reserved = [(i, r["memory"]["reserved_peak_bytes"] / 1e9) for i, r in enumerate(rs)
                    if r["memory"].get("reserved_peak_bytes")]
        if reserved:
            ax.plot(*zip(*reserved), "k_", ms=14, mew=2, label="reserved (allocator replay)")
        device = [r["memory"].get("device_bytes") for r in rs]
        if any(device):
            top = max(d for d in device if d) / 1e9
            reserve = max(r["memory"].get("cuda_reserve_bytes", 0) for r in rs) / 1e9
            ax.axhline(top, color="k", lw=1.2, label=f"device {top:g} GB")
            ax.axhline(top - reserve, color="k", lw=1, ls="--", label=f"less CUDA reserve {reserve:g} GB")
        ax.set_xticks(range(len(rs)), labels, fontsize=7)
        for tick, r in zip(ax.get_xticklabels(), rs):
            if r["status"] != "ok":
                tick.set_color(TEXT_COLOR)
        ax.set(ylabel="GB (simulated)", title=f"{experiment}: rank {rs[0].get('simulated_rank', 0)} of each point (SIMULATED)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # beside the bars
        ax.grid(alpha=0.3, axis="y")
    return fig


def _simulated_label(record: dict) -> str:
    """A bar's label in short lines, each no wider than the bar at the notebook's dpi: the model
    without its experiment's prefix (fig4_1.38b@L42 -> 1.38b, L42; fig2_80b_h128 -> 80b, h128), OOM,
    the stage, MP and ZeRO-R."""
    name = record["model"]["name"]
    name = name.split("_", 1)[1] if "_" in name else name
    stage = "DP" if record["stage"] == 0 else STAGE_NAMES[record["stage"]]
    zero_r = _zero_r_label(record).strip().replace("+cpu", "+\ncpu")  # Pa+cpu+MD in two lines: one bar wide
    lines = [*name.replace("_", "@").split("@"), *(["OOM"] if record["status"] == "oom" else []), stage, f"MP{record['tp']}",
             *zero_r.split("\n")]
    return "\n".join(line for line in lines if line)


def _zero_r_label(record: dict) -> str:
    zero = record.get("config", {}).get("zero", {})
    names = [n for k, n in (("partition_activations", "Pa"), ("cpu_checkpointing", "cpu"),
                            ("contiguous_memory_optimization", "MD")) if zero.get(k)]
    return f" {'+'.join(names)}" if names else ""


FIGURES = {"throughput_vs_size": throughput_vs_size, "scaling": scaling, "largest_model": largest_model,
           "largest_model_cpu": largest_model_cpu, "memory_bars": memory_bars, "communication": communication,
           "fig2_predicted": fig2_predicted, "fig3_predicted": fig3_predicted, "fig4_predicted": fig4_predicted, "fig8_predicted": fig8_predicted,
           "simulated_memory": simulated_memory}
