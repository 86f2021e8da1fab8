"""`python -m experiments.validate`: on small files written here in each development-set schema,
the summary equals a hand computation from its own per-row output, refused rows carry their
reasons, a row's inputs are the ones worked by hand, and bad input is one line with exit code 2."""
from __future__ import annotations

import csv
from dataclasses import replace
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest

from experiments import validate
from experiments.analysis import measured
from experiments.analysis import step_time as st
from experiments.analysis.hardware import profile

REPO = Path(__file__).resolve().parents[2]
VTRAIN_HEADER = ["# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers",
                 "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism",
                 "iteration time (ms)"]
THROUGHPUT_HEADER = ["source", "gpu", "gpus", "model", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                     "seq_len", "micro_batch", "global_batch", "sharding", "dp", "tp", "pp", "cp", "precision",
                     "activation_checkpointing", "measured_tokens_per_s_per_gpu", "measured_tokens_per_s_total"]
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
FULL_SHARD = "FSDP1 FULL_SHARD (ZeRO-3 equivalent)"


def write(path: Path, header: list[str], rows: list[list], bom: bool = False) -> Path:
    with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
        csv.writer(f).writerows([header, *rows])
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = validate.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(capsys, *args: str) -> dict:
    code, out, err = run(capsys, *args, "format=json")
    assert code == 0, err
    return json.loads(out)


def p90(values: list[float]) -> float:
    """The 90th percentile, linear between order statistics, by hand."""
    v = sorted(values)
    pos = 0.9 * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def check_summary_by_hand(result: dict, time_ratio, groups: dict[str, str]) -> None:
    """The summary's error and median ratios, recomputed from per_row's predicted and measured."""
    done = [r for r in result["per_row"] if r["status"] == "predicted"]
    ratios = [time_ratio(r) for r in done]
    errors = [abs(x - 1) for x in ratios]
    s = result["summary"]
    assert s["predicted"] == len(done) and s["refused"] == len(result["per_row"]) - len(done)
    assert s["error"]["median"] == pytest.approx(median(errors))
    assert s["error"]["p90"] == pytest.approx(p90(errors))
    assert s["error"]["worst"] == pytest.approx(max(errors))
    assert s["error"]["median_ratio"] == pytest.approx(median(ratios))
    assert done[errors.index(max(errors))]["index"] == s["error"]["worst_row"]
    for label, value_of in groups.items():
        by = {}
        for r, x in zip(done, ratios):
            by.setdefault(value_of(r), []).append(x)
        groups_rows = {v: g["rows"] for v, g in s["median_ratio_by_group"][label].items()}
        assert groups_rows == {v: len(x) for v, x in by.items()}
        for value, g in s["median_ratio_by_group"][label].items():
            assert g["median_ratio"] == pytest.approx(median(by[value])), (label, value)
    for r in done:   # the breakdown adds up to the predicted step
        assert sum(r["terms"].values()) == pytest.approx(r["predicted_step_s"])


def test_a_vtrain_file_is_summarised_as_its_rows_give(tmp_path, capsys):
    rows = [[2, 16, 1, 1024, 16, 2, 1024, 1, 2, 1, 60.0], [2, 16, 1, 1024, 16, 2, 1024, 2, 1, 1, 90.0],
            [8, 32, 2, 1024, 16, 4, 1024, 4, 2, 1, 70.0], [8, 32, 2, 1024, 16, 4, 1024, 8, 1, 1, 80.0],
            [8, 32, 2, 1024, 16, 4, 1024, 2, 2, 2, 50.0],     # pipelined: refused
            [8, 32, 2, 1000, 12, 4, 1024, 8, 1, 1, 50.0]]     # TP 8 does not divide 12 heads: refused
    path = write(tmp_path / "single.csv", VTRAIN_HEADER, rows, bom=True)   # vTrain's files start with a BOM
    result = as_json(capsys, path)
    per = result["per_row"]
    assert [r["index"] for r in per] == list(range(6)) and {r["unit"] for r in per} == {"s/step"}
    assert [r["status"] for r in per] == ["predicted"] * 4 + ["refused"] * 2
    assert per[4]["reason"] == "pipeline parallelism > 1: not modelled" and per[4]["predicted"] is None
    assert per[5]["reason"].startswith("shape: tensor-parallel size 8 must divide heads (12)")
    assert result["summary"]["refused_by_reason"] == {per[4]["reason"]: 1, per[5]["reason"]: 1}
    assert {r["system"] for r in per[:4]} == {"megatron_ds2023"} and {r["cluster"] for r in per[:4]} == {"dgx_a100"}
    assert [r["measured"] for r in per[:4]] == [0.06, 0.09, 0.07, 0.08]
    # the first row as the model's input, by hand: vTrain's vocabulary, fp16, recomputation,
    # 16 sequences over DP 2 at micro-batch 1: 8 micro-batches
    x = st.StepInputs(**st.shape_inputs({"layers": 2, "hidden": 1024, "heads": 16, "seq_len": 1024,
                                         "vocab_size": 50257}, 1), micro_batch=1, tp=1, dp=2, stage=0, grad_accum=8)
    assert per[0]["predicted"] == pytest.approx(st.predict(x, profile("dgx_a100"), "megatron_ds2023").step_s)
    check_summary_by_hand(result, lambda r: r["predicted"] / r["measured"],
                          {"TP": lambda r: str(rows[r["index"]][7]), "sequence length": lambda r: "<=2k"})
    code, out, _ = run(capsys, path)   # the table: the same numbers
    e = result["summary"]["error"]
    assert code == 0 and f"median {e['median']:.3f}, p90 {e['p90']:.3f}, worst {e['worst']:.3f}" in out
    assert "      1  pipeline parallelism > 1: not modelled" in out


def test_the_multi_node_schema_and_a_system_given(tmp_path, capsys):
    rows = [[3.6, 64, 512, 8, 3072, 32, 2, 2048, 1, 64, 1, 300.0], [3.6, 64, 512, 4, 3072, 32, 2, 2048, 8, 8, 1, 900.0]]
    path = write(tmp_path / "multi.csv", ["Parameters (billion)", *VTRAIN_HEADER], rows)
    result = as_json(capsys, path, "system=zero_repro", "cluster=dgx_h100")
    assert [(r["system"], r["cluster"], r["status"]) for r in result["per_row"]] == [
        ("zero_repro", "dgx_h100", "predicted")] * 2
    assert result["summary"]["predicted_by"] == {"zero_repro on dgx_h100": 2}
    check_summary_by_hand(result, lambda r: r["predicted"] / r["measured"], {"TP": lambda r: ("1", "8")[r["index"]]})


def throughput_row(**over) -> dict:
    row = {"source": FOUNDRY, "gpu": "A100 80GB", "gpus": 8, "model": "MPT-tiny", "layers": 2, "hidden": 512,
           "heads": 8, "kv_heads": 8, "ffn_hidden": 2048, "vocab": 50368, "seq_len": 2048, "micro_batch": 4,
           "global_batch": 64, "sharding": FULL_SHARD, "dp": 8, "tp": 1, "pp": 1, "cp": 1, "precision": "bf16",
           "activation_checkpointing": "False", "measured_tokens_per_s_per_gpu": 50000,
           "measured_tokens_per_s_total": ""}
    return {**row, **over}


THROUGHPUT_ROWS = [throughput_row(),
                   throughput_row(seq_len=8192, micro_batch=1, global_batch=16, activation_checkpointing="True",
                                  measured_tokens_per_s_per_gpu="", measured_tokens_per_s_total=240000),
                   throughput_row(seq_len=32768, micro_batch=1, global_batch=8, measured_tokens_per_s_per_gpu=9000),
                   throughput_row(gpu="A100 40GB"),
                   throughput_row(kv_heads=2),
                   throughput_row(pp=2, dp=4)]


@pytest.fixture
def foundry_file(tmp_path) -> Path:
    return write(tmp_path / "fsdp.csv", THROUGHPUT_HEADER, [[r[c] for c in THROUGHPUT_HEADER] for r in THROUGHPUT_ROWS])


def test_llm_foundry_rows_are_predicted_by_its_fsdp1_system_and_another_source_is_refused(tmp_path, foundry_file, capsys):
    result = as_json(capsys, foundry_file)
    per = result["per_row"]
    assert [(r["status"], r["system"], r["cluster"]) for r in per[:5]] == [
        ("predicted", "llm_foundry_fsdp1", "dgx_a100")] * 3 + [("predicted", "llm_foundry_fsdp1", "dgx_a100_40gb"),
                                                              ("predicted", "llm_foundry_fsdp1", "dgx_a100")]
    assert per[5]["reason"] == "pipeline parallelism > 1: not modelled"
    # the first row by hand: MPT's block as llm-foundry builds it (biases, learned positions, tied,
    # GeLU, LayerNorm: GPT-2's), stage 3, 2 micro-batches of 4 over DP 8, bf16, no mixed-precision
    # column: reduced in the parameters' dtype
    x = st.StepInputs(**st.shape_inputs({"layers": 2, "hidden": 512, "heads": 8, "seq_len": 2048,
                                         "vocab_size": 50368}, 1), micro_batch=4, tp=1, dp=8, stage=3,
                      recompute=False, grad_accum=2, element_bytes=2)
    assert per[0]["predicted_step_s"] == pytest.approx(st.predict(x, profile("dgx_a100"), "llm_foundry_fsdp1").step_s)
    # grouped-query attention is the torch block's (4 KV heads of 8 -> 2): a smaller QKV GEMM
    assert per[4]["predicted_step_s"] < per[0]["predicted_step_s"]
    # a source no system models is refused with its name; a system given predicts it
    other = write(tmp_path / "other.csv", THROUGHPUT_HEADER,
                  [[throughput_row(source="someone's benchmark")[c] for c in THROUGHPUT_HEADER]])
    reason = as_json(capsys, other)["per_row"][0]["reason"]
    assert reason == ("no system models someone's benchmark's stack "
                      "(system= names one: zero_repro predicts this engine at the row's ZeRO stage)")
    code, out, _ = run(capsys, other)
    assert code == 0 and f"      1  {reason}" in out and "no row predicted" in out
    stages = as_json(capsys, foundry_file, "system=megatron_ds2023")["per_row"][0]["reason"]
    assert stages == "system megatron_ds2023 runs ZeRO stages [0], not 3"


def test_the_rows_attention_impl_picks_the_kernel_and_h100_rows_are_predicted(tmp_path, capsys):
    header = THROUGHPUT_HEADER + ["attention_impl"]
    impls = ["triton (submit_benchmarks.py default)", "", "flash2", "flash (v2.3.6)", "flash", "Triton;", "torch"]
    rows = [throughput_row(attention_impl=a) for a in impls] + [throughput_row(gpu="H100 80GB", attention_impl="triton"),
                                                                throughput_row(gpu="H100 80GB", precision="amp_fp8",
                                                                               attention_impl="")]
    per = as_json(capsys, write(tmp_path / "impl.csv", header, [[r[c] for c in header] for r in rows]))["per_row"]
    step = [r["predicted_step_s"] for r in per]
    # triton (any case) is the system's own kernel, llm-foundry's default: as an empty cell
    assert step[0] == step[1] == step[5]
    assert step[2] == step[3]                 # flash-attn with its version 2 named: FlashAttention-2
    x = st.StepInputs(**st.shape_inputs({"layers": 2, "hidden": 512, "heads": 8, "seq_len": 2048,
                                         "vocab_size": 50368}, 1), micro_batch=4, tp=1, dp=8, stage=3,
                      recompute=False, grad_accum=2, element_bytes=2)
    for i, kernel in ((0, None), (2, "flash2")):
        by_hand = st.predict(replace(x, attention=kernel), profile("dgx_a100"), "llm_foundry_fsdp1").step_s
        assert step[i] == pytest.approx(by_hand), impls[i]
    assert step[2] < step[0]                  # FlashAttention-2 beats the Triton kernel
    why = ("not one the model prices (its first word one of triton, flash2, or flash with its version 2; a bare "
           "'flash' does not say which flash-attn ran)")
    # a bare 'flash' (v1 or v2?) and MPT's torch attention (no measured rate checks the unfused path) refused
    assert [per[i]["reason"] for i in (4, 6)] == [f"attention_impl 'flash': {why}", f"attention_impl 'torch': {why}"]
    # an H100 row: its GPU's profile and the H100 rates; fp8 is refused
    assert (per[7]["status"], per[7]["cluster"]) == ("predicted", "dgx_h100")
    assert per[7]["predicted_step_s"] == pytest.approx(st.predict(x, profile("dgx_h100"), "llm_foundry_fsdp1").step_s)
    assert per[8]["reason"] == "precision 'amp_fp8': not modelled"


def test_fsdp_rows_predicted_by_this_engine_at_stage_3(foundry_file, capsys):
    result = as_json(capsys, foundry_file, "system=zero_repro")
    per = result["per_row"]
    assert [r["status"] for r in per] == ["predicted"] * 5 + ["refused"]
    assert per[3]["cluster"] == "dgx_a100_40gb"
    # the measured step from tokens per second: 64 x 2048 tokens at 50000 a second on each of 8 GPUs;
    # the second row has only the total: 240000 / 8 a GPU
    assert per[0]["measured_step_s"] == pytest.approx(64 * 2048 / (50000 * 8)) and per[1]["measured"] == 30000
    # the first row by hand: MPT's shape as the model's GPT, stage 3, no recomputation, bf16,
    # 64 sequences over DP 8 at micro-batch 4: 2 micro-batches
    x = st.StepInputs(**st.shape_inputs({"layers": 2, "hidden": 512, "heads": 8, "seq_len": 2048,
                                         "vocab_size": 50368}, 1), micro_batch=4, tp=1, dp=8, stage=3,
                      recompute=False, grad_accum=2, element_bytes=2)
    step = st.predict(x, profile("dgx_a100"), "zero_repro").step_s
    assert per[0]["predicted_step_s"] == pytest.approx(step)
    assert per[0]["predicted"] == pytest.approx(64 * 2048 / (step * 8))   # tokens / s / GPU
    check_summary_by_hand(result, lambda r: r["measured"] / r["predicted"],   # time ratio: throughputs inverted
                          {"sequence length": lambda r: ("<=2k", "4-8k", ">=16k", "<=2k", "<=2k")[r["index"]],
                           "GPU": lambda r: ("A100 40GB" if r["index"] == 3 else "A100 80GB"),
                           "sharding": lambda r: FULL_SHARD,
                           "activation checkpointing": lambda r: ("False", "True", "False", "False", "False")[r["index"]]})
    given = as_json(capsys, foundry_file, "system=zero_repro", "cluster=dgx_a100")["per_row"]
    assert given[3]["status"] == "predicted" and given[3]["predicted"] == pytest.approx(per[0]["predicted"])


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    other = write(tmp_path / "other.csv", ["a", "b"], [[1, 2]])
    code, out, err = run(capsys, other)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "match no known schema" in err
    code, _, err = run(capsys, other, "system=nope")
    assert code == 2 and err.startswith("error: system must be one of ['megatron2019'") and err.count("\n") == 1
    code, _, err = run(capsys, other, "sytem=zero_repro")
    assert code == 2 and "unknown key 'sytem'" in err and "did you mean 'system'?" in err
    code, _, err = run(capsys, tmp_path / "missing.csv")
    assert code == 2 and "no such file" in err
    # a row that does not parse is refused with the column, the rest of the file still runs
    bad = write(tmp_path / "bad.csv", VTRAIN_HEADER, [[2, 16, 0, 1024, 16, 2, 1024, 1, 2, 1, 60.0],
                                                      [2, 16, 1, 1024, 16, 2, 1024, 1, 2, 1, "n/a"]])
    reasons = [r["reason"] for r in as_json(capsys, bad)["per_row"]]
    assert reasons == ["unreadable: column micro batch = '0'", "unreadable: column iteration time (ms) = 'n/a'"]
    # the module as users run it
    done = subprocess.run([sys.executable, "-m", "experiments.validate", str(other), "cluster=moon"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: cluster must be one of ['dgx2_v100', 'dgx2h_v100', 'dgx_h100', 'dgx_a100', 'dgx_a100_800g', "
        "'dgx_a100_40gb'], "
        "got 'moon'"]


def test_the_development_set_files_are_read_from_results_external():
    external = REPO / "results" / "external"
    single = measured.read(external / "vtrain_a100_single_node.csv")
    multi = measured.read(external / "vtrain_a100_multi_node.csv")
    fsdp = measured.read(external / "llm_foundry_a100_fsdp.csv")
    assert (single[0], len(single[1]), multi[0], len(multi[1]), fsdp[0], len(fsdp[1])) == (
        measured.VTRAIN, 1440, measured.VTRAIN, 109, measured.THROUGHPUT, 139)
    assert sum(r["pp"] == 1 for r in measured.vtrain_rows(external / "vtrain_a100_multi_node.csv")) == 28
    schema, outcomes = measured.predict_file(external / "llm_foundry_a100_fsdp.csv")
    # every row llm-foundry's, each on the profile of its GPU, its reduce dtype from its mode
    assert {(o.reason, o.system) for o in outcomes} == {(None, "llm_foundry_fsdp1")}
    assert {(o.row["gpu"], o.cluster) for o in outcomes} == {("A100 40GB", "dgx_a100_40gb"), ("A100 80GB", "dgx_a100")}
    assert {o.row["mixed_precision_mode"].split()[0] for o in outcomes} == {"PURE", "DEFAULT"}


def family_outcome(index: int, micro_batch: int, checkpointing: bool, speed: float, predicted: float | None,
                   **over) -> measured.Outcome:
    """A throughput outcome by hand: the typed row of throughput_row (micro-batch and checkpointing
    given, the global batch following at 2 micro-batches over DP 8), measured (speed) and predicted
    tokens/s/GPU (predicted None: refused)."""
    text = {k: str(v) for k, v in throughput_row(micro_batch=micro_batch, global_batch=16 * micro_batch,
                                                  activation_checkpointing=str(checkpointing),
                                                  measured_tokens_per_s_per_gpu=speed, **over).items()}
    row = measured.throughput_row(text) | {"seq_band": measured.seq_band(int(text["seq_len"]))}
    tokens = row["global_batch"] * row["seq_len"]
    step = (None if predicted is None
            else st.StepTime({"compute": tokens / (predicted * row["gpus"])}, 0.0, "dgx_a100", "llm_foundry_fsdp1"))
    return measured.Outcome(index, row, speed, tokens / (speed * row["gpus"]), prediction=step,
                            reason="refused by hand" if step is None else None, tokens_per_step=tokens)


def test_the_fastest_in_family_check_by_hand():
    outcomes = [
        # family A (micro-batch 1, 2, 4 with checkpointing): measured fastest micro-batch 2, the
        # model's too: right; the rule (largest micro-batch without checkpointing: 2) right
        family_outcome(0, 1, False, 100.0, 90.0), family_outcome(1, 2, False, 120.0, 130.0),
        family_outcome(2, 4, True, 110.0, 100.0),
        # family B: measured fastest micro-batch 4 without checkpointing, the model ranks micro-batch
        # 8 with it first: wrong; the rule right
        family_outcome(3, 4, False, 200.0, 150.0, seq_len=4096), family_outcome(4, 8, True, 180.0, 170.0, seq_len=4096),
        # family C: a measured tie: the model's fastest (the first row) is one of the tied: right;
        # the rule's (micro-batch 4) too; the runner-up gap 0
        family_outcome(5, 2, False, 50.0, 60.0, gpus=16, dp=16), family_outcome(6, 4, False, 50.0, 55.0, gpus=16, dp=16),
        # no family: family A's run but another software image (an unrecorded image is not known
        # equal); another sequence length beside a refused row (only predicted rows count)
        family_outcome(7, 8, False, 999.0, 999.0, software="not recorded"),
        family_outcome(8, 1, False, 10.0, 10.0, seq_len=1024), family_outcome(9, 2, False, 20.0, None, seq_len=1024)]
    assert outcomes[1].predicted == pytest.approx(130.0) and outcomes[9].prediction is None
    assert [[o.index for o in f] for f in measured.families(outcomes)] == [[0, 1, 2], [3, 4], [5, 6]]
    r = measured.fastest_in_family(measured.THROUGHPUT, outcomes)
    assert (r["families"], r["rows"], r["right"], r["rule_right"]) == (3, 7, 2, 3)
    assert r["fraction"] == pytest.approx(2 / 3)
    assert r["runner_up_gap_median"] == pytest.approx(120 / 110 - 1) and r["runner_up_gap_min"] == 0
    # the model wrong in its only family; the rule wrong where checkpointing wins
    wrong = measured.fastest_in_family(measured.THROUGHPUT, outcomes[3:5])
    assert (wrong["families"], wrong["right"], wrong["fraction"], wrong["rule_right"]) == (1, 0, 0.0, 1)
    flipped = [family_outcome(0, 4, False, 100.0, 120.0), family_outcome(1, 8, True, 130.0, 125.0)]
    r = measured.fastest_in_family(measured.THROUGHPUT, flipped)
    assert (r["families"], r["right"], r["fraction"], r["rule_right"]) == (1, 1, 1.0, 0)
    # no family: nothing ranked, untested; a vTrain file has no such check
    alone = measured.fastest_in_family(measured.THROUGHPUT, outcomes[7:])
    assert (alone["families"], alone["right"], alone["fraction"], alone["runner_up_gap_median"]) == (0, 0, None, None)
    assert measured.fastest_in_family(measured.VTRAIN, outcomes) is None
    assert measured.summary(measured.THROUGHPUT, outcomes)["fastest_in_family"] == measured.fastest_in_family(
        measured.THROUGHPUT, outcomes)


def test_validate_prints_the_fastest_in_family_check_and_its_json(tmp_path, capsys):
    # a family of micro-batch 4 and 8 (the global batch following) beside a row of its own
    rows = [throughput_row(), throughput_row(micro_batch=8, global_batch=128), throughput_row(seq_len=4096)]
    path = write(tmp_path / "family.csv", THROUGHPUT_HEADER, [[r[c] for c in THROUGHPUT_HEADER] for r in rows])
    predicted = [r["predicted"] for r in as_json(capsys, path)["per_row"]]
    model_first = 0 if predicted[0] > predicted[1] else 1
    for measured_first, right in ((model_first, 1), (1 - model_first, 0)):   # the model right, then wrong
        for i, r in enumerate(rows[:2]):
            r["measured_tokens_per_s_per_gpu"] = 60000 if i == measured_first else 40000
        write(path, THROUGHPUT_HEADER, [[r[c] for c in THROUGHPUT_HEADER] for r in rows])
        s = as_json(capsys, path)["summary"]["fastest_in_family"]
        assert (s["families"], s["rows"], s["right"], s["fraction"]) == (1, 2, right, float(right))
        assert s["runner_up_gap_median"] == pytest.approx(0.5)
        code, out, _ = run(capsys, path)
        assert code == 0 and f"right in {right} of 1 ({right:.0%});" in out and "runner-up 50.0% slower" in out
    # a vTrain file: no such line, null in its summary
    vtrain = write(tmp_path / "v.csv", VTRAIN_HEADER, [[2, 16, 1, 1024, 16, 2, 1024, 1, 2, 1, 60.0]])
    assert as_json(capsys, vtrain)["summary"]["fastest_in_family"] is None
    assert "fastest in family" not in run(capsys, vtrain)[1]
