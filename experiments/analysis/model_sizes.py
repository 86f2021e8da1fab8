"""Parameter counts of every model shape in the paper's appendix tables, without allocating.

    python -m experiments.analysis.model_sizes

Prints, per distinct shape: where it appears, its printed label, our count of megatron-core's
GPT (closed form, vocabulary 50257 padded to 50304, sequence 1024, tied output layer; the tests
check the closed form against models built on the meta device), the transformer layers alone
(12·l·h²) and Narayanan et al.'s Eq. 2.
"""
from __future__ import annotations

import csv
from pathlib import Path

from experiments.models.gpt_shape import GPTShape, narayanan_eq2, parameter_count

PAPER_DIR = Path(__file__).resolve().parents[2] / "results" / "paper"


def paper_shapes() -> list[dict]:
    """One row per distinct (label, layers, hidden, heads) of appendix Tables 5-10."""
    with open(PAPER_DIR / "appendix_configs_all.csv") as f:
        rows = list(csv.DictReader(f))
    seen: dict[tuple, dict] = {}
    for row in rows:
        key = (row["model_size_label_as_printed"], row["layers"], row["hidden"], row["attention_heads"])
        entry = seen.setdefault(key, {"label": key[0], "shape": GPTShape(int(key[1]), int(key[2]), int(key[3])),
                                      "where": []})
        where = f"{row['source_table']} ({row['body_figure'].split(' (')[0]})"
        if where not in entry["where"]:
            entry["where"].append(where)
    return list(seen.values())


def size_table() -> list[dict]:
    table = []
    for entry in paper_shapes():
        shape = entry["shape"]
        nominal = float(entry["label"].replace("p", ".").rstrip("B"))
        count = parameter_count(shape)
        table.append({"label": entry["label"], "where": ", ".join(entry["where"]), "layers": shape.layers,
                      "hidden": shape.hidden, "heads": shape.heads, "params_B": count / 1e9,
                      "layers_only_B": 12 * shape.layers * shape.hidden ** 2 / 1e9,
                      "eq2_B": narayanan_eq2(shape) / 1e9, "vs_label_pct": 100 * (count / 1e9 / nominal - 1)})
    return table


def main() -> None:
    print("| label | appears in | layers | hidden | heads | params (B) | 12lh² (B) | Eq. 2 (B) | vs label |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in size_table():
        print(f"| {r['label']} | {r['where']} | {r['layers']} | {r['hidden']} | {r['heads']} | {r['params_B']:.3f} "
              f"| {r['layers_only_B']:.3f} | {r['eq2_B']:.3f} | {r['vs_label_pct']:+.1f}% |")


if __name__ == "__main__":
    main()
