"""Section 7's communication volumes (claims S7-1..3: data parallelism and Pos+g move 2Ψ
elements per training step, Pos+g+p 3Ψ) against the engine's counts in the records.

The paper counts one training step of one micro-batch per rank: a forward, a backward that
reduces each gradient once, an optimizer step. Stages 0 and 1 reduce the gradients once per
optimizer step however many micro-batches it accumulates (train.grad_accum_steps, as
experiments/plan.py's records for a global batch do), so their records count at any
accumulation. Stages 2 and 3 reduce-scatter every micro-batch (stage 3 also gathers the
parameters for each), (m + 1)Ψ and 3mΨ for m micro-batches (reports/tables.py
theory_elements_per_step): not the claim's step, so their accumulating records are left out and
counted.

Stage 3 keeps the root unit (embeddings, final norm, head) gathered from the end of forward to
its backward by default (zero.stage3_keep_root, as FSDP2 keeps its root), which saves the root's
second gather: the engine's own formula for a record is 3Ψ less the root's elements
(comm.theory_elements_per_step). `stage3_keep_root=false` runs the paper's schedule, every unit
gathered twice: 3Ψ.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def micro_batches_per_step(record: dict) -> int:
    """The micro-batches the record's optimizer step accumulates (train.grad_accum_steps)."""
    return int(record.get("config", {}).get("train", {}).get("grad_accum_steps") or 1)


@dataclass
class Counted:
    """One stage's records that test the claim, as ratios to Ψ (the record's parameters per rank)."""
    per_psi: list[float] = field(default_factory=list)     # data-parallel elements per step / Ψ
    vs_formula: list[float] = field(default_factory=list)  # those elements / the engine's formula for the record
    root_kept: list[float] = field(default_factory=list)   # stage 3: the root's second gather saved / Ψ


def tests_the_claim(record: dict) -> bool:
    """Whether the record's optimizer step moves what Sec 7's step does: at stages 0-1 always (one
    gradient reduction per step), at stages 2-3 only with one micro-batch a step."""
    return record["stage"] < 2 or micro_batches_per_step(record) == 1


def counted(records: list[dict], simulated: bool) -> tuple[dict[int, Counted], dict[int, int]]:
    """By stage, the ok records with DP > 1 (measured on CPU, or simulated) that test the claim;
    and by stage, how many such records at stages 2-3 accumulate micro-batches and were left out.
    ZeRO-R's Pa all-gathers, over the MP group, are not Section 7's volume and stay out (records
    without the split have none)."""
    out: dict[int, Counted] = {}
    left_out: dict[int, int] = {}
    for r in records:
        if r.get("status") != "ok" or r.get("dp", 1) <= 1 or not r.get("params_per_gpu"):
            continue
        if (r.get("measured_by") == "simulated") != simulated:
            continue
        if not tests_the_claim(r):
            left_out[r["stage"]] = left_out.get(r["stage"], 0) + 1
            continue
        comm, psi = r["comm"], r["params_per_gpu"]
        elements = comm.get("dp_elements_per_step", comm["elements_per_step"])
        c = out.setdefault(r["stage"], Counted())
        c.per_psi.append(elements / psi)
        c.vs_formula.append(elements / comm["theory_elements_per_step"])
        if r["stage"] == 3:
            c.root_kept.append((3 * psi - comm["theory_elements_per_step"]) / psi)
    return out, left_out


def _fmt_range(values: list[float]) -> str:
    return f"{min(values):.4f}" if max(values) - min(values) < 5e-5 else f"{min(values):.4f}-{max(values):.4f}"


def _left_out(n: int) -> str:
    return (f"; {n} record{'s' if n != 1 else ''} accumulating micro-batches left out (the claim is per step of one "
            "micro-batch; stages 2-3 reduce-scatter the gradients once per micro-batch)") if n else ""


def comm_claim(records: list[dict], stage: int, theory: int) -> tuple[str, str, str]:
    """(ours, kind, how) of the claim that `stage` moves `theory`Ψ elements per step: simulated
    records where there are some at that stage, else the CPU's, else the formula; with how many
    records at that stage were left out for accumulating micro-batches."""
    sources = {simulated: counted(records, simulated) for simulated in (True, False)}
    left_out = sum(skipped.get(stage, 0) for _, skipped in sources.values())
    for simulated, kind, source in ((True, "simulated", "engine counts at full world size (simulate=true records), "
                                                        "data-parallel traffic"),
                                    (False, "measured (CPU)", "engine counts of the ok records with DP > 1 (padding "
                                                              "and the gradient norm's scalars included)")):
        c = sources[simulated][0].get(stage)
        if c is None:
            continue
        ours = f"{_fmt_range(c.per_psi)}Ψ per step (stage {stage})"
        if stage == 3 and max(c.root_kept) > 0:
            ours += (f": 3Ψ less the root unit's second gather, {_fmt_range(c.root_kept)}Ψ here, which "
                     "stage3_keep_root (the default) saves; stage3_keep_root=false gives 3Ψ")
        how = (f"{source}; {_fmt_range(c.vs_formula)}x the engine's formula for each record"
               + (" (3Ψ less the root kept gathered)" if stage == 3 else "") + f"; the paper's {theory}Ψ")
        return ours + _left_out(left_out), kind, how
    return f"{theory}Ψ" + _left_out(left_out), "formula", "Sec 7 volumes; no records with DP > 1 given to this report"
