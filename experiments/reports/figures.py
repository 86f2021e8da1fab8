"""The report's figures (matplotlib), each with the hardware and, for throughput, the FLOPs
convention in its title; the paper's points are drawn beside ours and marked APPROX when they
were read from a figure. Used by report.py and notebooks/figures.ipynb."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "zero-repro"  # stable element ids: regenerated SVGs diff cleanly
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments.analysis.memory import model_state_bytes  # noqa: E402

from .tables import STAGE_NAMES, paper_throughput  # noqa: E402

FLOPS_NOTE = "model FLOPs: Narayanan et al. Eq. 3, c = 4 with recomputation, 3 without"
STAGE_COLORS = {"baseline DP": "tab:gray", "Pos": "tab:blue", "Pos+g": "tab:orange", "Pos+g+p": "tab:green"}
KIND_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer_states": "tab:green"}


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] == "ok"]


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


def _two_panels(title: str, records: list[dict]) -> tuple[Figure, tuple]:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    fig.suptitle(f"{title}\nmeasured on: {hardware_label(records)}", fontsize=10)
    return fig, axes


def _finish(*axes) -> None:
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4")


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
    ours.set(xscale="log", xlabel=f"parameters ({letter})", ylabel="TFLOPs / GPU", title=title)
    for series, marker in (("ZeRO", "s-"), ("Baseline", "^-")):
        p = paper[(paper.experiment == "fig2") & (paper.series == series) & paper.exactness.str.startswith("APPROX")]
        theirs.plot([float(x[:-1]) for x in p.x], p.paper_tflops_per_gpu, marker, label=f"paper {series} (APPROX)")
    theirs.set(xlabel="parameters (B)", ylabel="TFLOPs / GPU", title="paper, Figure 2: 400 V100 (read from a figure)")
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
    if not main:
        _empty(ours, "no ok records selected")
    ours.set(xlabel="GPUs (ranks)", ylabel="TFLOPs / GPU", title=f"this suite: {main[0]['experiment']}" if main else "this suite")
    p = paper[paper.experiment == "fig3"]
    theirs.plot([int(x.split()[0]) for x in p.x], p.paper_tflops_per_gpu, "s-", label="paper 60B, ZeRO (APPROX)")
    theirs.set(xlabel="GPUs", ylabel="TFLOPs / GPU", title="paper, Figure 3: 60B at MP 16 (read from a figure)")
    _finish(ours, theirs)
    return fig


def largest_model(records: list[dict], paper: pd.DataFrame | None = None) -> Figure:
    """Figure 4 style: the largest model each stage trained (ok records), and its throughput."""
    paper = paper_throughput() if paper is None else paper
    fig, (ours, theirs) = _two_panels(f"Largest model trained, and its throughput ({FLOPS_NOTE})", records)
    ok = _ok(records)
    best = {}
    for r in ok:
        if r["params"] > best.get(r["stage"], {"params": -1})["params"]:
            best[r["stage"]] = r
    names = [STAGE_NAMES[s] for s in sorted(best)]
    unit, letter = _scale([r["params"] for r in best.values()])
    sizes = [best[s]["params"] / unit for s in sorted(best)]
    bars = ours.bar(names, sizes, color=[STAGE_COLORS[n] for n in names])
    for bar, s in zip(bars, sorted(best)):
        ours.annotate(f"{best[s]['tflops_per_gpu']:.3g} TFLOPs/GPU", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    if not ok:
        _empty(ours, "no ok records selected")
    ours.set(ylabel=f"parameters ({letter})", title="this suite")
    for series, color in (("ZeRO", "tab:orange"), ("Baseline (DDP)", "tab:gray")):
        p = paper[(paper.experiment == "fig4") & (paper.series == series)]
        theirs.bar(p.x, p.paper_tflops_per_gpu, color=color, label=f"paper {series} (APPROX)")
    theirs.set(ylabel="TFLOPs / GPU", title="paper, Figure 4: 128 V100, no MP (read from a figure)")
    theirs.tick_params(axis="x", labelsize=7)
    theirs.legend(fontsize=8)
    return fig


def memory_bars(records: list[dict], psi: float = 7.5e9, nds: tuple[int, ...] = (1, 4, 16, 64)) -> Figure:
    """Stacked model-state bars per stage and Nd: the paper's 16Ψ shrinking to 16Ψ/Nd (its
    Figure 1 example, 7.5B), and the suite's measured bytes beside their prediction."""
    fig, (theory, measured) = _two_panels("Model-state memory per device by stage and DP degree", records)
    labels, bottoms = [], []
    for stage in range(4):
        for nd in nds:
            labels.append(f"{STAGE_NAMES[stage]}\nNd={nd}")
            bottoms.append(model_state_bytes(psi, stage, nd))
    _stack(theory, labels, [{k: b[k] / 1e9 for k in KIND_COLORS} for b in bottoms])
    theory.set(ylabel="GB", title=f"memory model, Ψ = {psi / 1e9:g}B, K = 12 (Table 1)")
    ok = [r for r in _ok(records) if r["tp"] == 1]
    pool = [r for r in ok if r["experiment"] == "table1"] or _main_experiment(ok)  # table1 measures exactly this
    model = max(pool, key=lambda r: r["params"])["model"]["name"] if pool else None
    chosen = sorted((r for r in pool if r["model"]["name"] == model), key=lambda r: (r["stage"], r["dp"]))
    if chosen:
        _stack(measured, [f"{STAGE_NAMES[r['stage']]}\nNd={r['dp']}" for r in chosen],
               [{k: r["memory"]["measured"][k] / 1e6 for k in KIND_COLORS} for r in chosen])
        measured.plot(range(len(chosen)), [r["memory"]["predicted"]["total"] / 1e6 for r in chosen], "k_", ms=18,
                      label="predicted total")
        measured.legend(fontsize=7)
    else:
        _empty(measured, "no ok records selected")
    measured.set(ylabel="MB", title=f"measured, rank 0: {chosen[0]['experiment']}, {model}, {chosen[0]['precision']}"
                 if chosen else "measured")
    return fig


def _stack(ax, labels: list[str], values: list[dict[str, float]]) -> None:
    bottom = [0.0] * len(labels)
    for kind, color in KIND_COLORS.items():
        heights = [v[kind] for v in values]
        ax.bar(range(len(labels)), heights, bottom=bottom, color=color, label=kind.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax.legend(fontsize=7)


def communication(records: list[dict]) -> Figure:
    """Elements moved per step, in units of Ψ, per stage: measured against 2Ψ / 3Ψ."""
    fig, (ax, detail) = _two_panels("Communication per training step (elements handed to torch.distributed)", records)
    ok = [r for r in _ok(records) if r["dp"] > 1 and r["params_per_gpu"]]
    for stage in range(4):
        ys = [r["comm"]["elements_per_step"] / r["params_per_gpu"] for r in ok if r["stage"] == stage]
        ax.scatter([stage] * len(ys), ys, color=STAGE_COLORS[STAGE_NAMES[stage]], zorder=3)
        ax.hlines(3 if stage == 3 else 2, stage - 0.3, stage + 0.3, color="k", lw=2)
    ax.set_xticks(range(4), [STAGE_NAMES[s] for s in range(4)])
    ax.set(ylabel="elements per step / Ψ", ylim=(0, 3.5), title="measured (dots) vs the paper's 2Ψ, 2Ψ, 2Ψ, 3Ψ (bars)")
    if not ok:
        _empty(ax, "no ok records with DP > 1")
    for stage in range(4):
        pts = sorted((r["dp"], r["comm"]["elements_per_step"]) for r in ok if r["stage"] == stage)
        if pts:
            detail.plot(*zip(*pts), "o", color=STAGE_COLORS[STAGE_NAMES[stage]], label=STAGE_NAMES[stage])
    detail.set(xlabel="DP degree", ylabel="elements per step", yscale="log", title="per record")
    if ok:
        detail.legend(fontsize=8)
    return fig


FIGURES = {"throughput_vs_size": throughput_vs_size, "scaling": scaling, "largest_model": largest_model,
           "memory_bars": memory_bars, "communication": communication}
