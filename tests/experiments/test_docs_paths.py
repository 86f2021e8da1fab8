"""The README and docs/ are true to a fresh clone: every file or folder they name is tracked by git."""
from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("results/runs", "results/reports", "results/slurm", "results/calibration", "outputs", "multirun",
             ".venv")  # made by runs


def tracked() -> tuple[set[str], set[str]]:
    done = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout:
        pytest.skip("not a git checkout")
    files = set(done.stdout.split())
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    return files, folders


def named_paths(text: str, folder: str = "") -> set[str]:
    """Repository paths a document in `folder` names: in `code` with a slash (from the repository
    root, as commands take them), and link or image targets (relative to the document)."""
    links = {posixpath.normpath(posixpath.join(folder, t)) for t in re.findall(r"\]\(([^)#\s]+)\)", text)
             if "://" not in t}
    found = set(re.findall(r"`([^`\s]*/[^`\s]*)`", text)) | links
    paths = set(re.findall(r"\b([A-Z][A-Z_]+\.md)\b", text))  # top-level documents: DESIGN.md, CHANGES.md...
    for item in found:
        if "://" in item or item.startswith(("-", "/", "~")) or any(c in item for c in "<>*=$%{}"):
            continue  # URLs, options, absolute paths, placeholders, overrides
        path = item.rstrip("/").removeprefix("./")
        if path.split("/")[0] in {p.split("/")[0] for p in tracked()[0]} or path.startswith(".."):
            paths.add(path)
    return paths


def test_readme_names_only_files_a_clone_has():
    files, folders = tracked()
    paths = named_paths((REPO / "README.md").read_text())
    assert "experiments/report.py" in paths and "results/reference/reports/largest_model.png" in paths
    assert "docs/simulation.md" in paths
    assert named_paths("see `../shared/notes.md` and DESIGN.md") == {"../shared/notes.md", "DESIGN.md"}
    missing = sorted(p for p in paths if p not in files and p not in folders and not p.startswith(GENERATED))
    assert not missing, f"the README names paths a fresh clone lacks: {missing}"


def test_docs_name_only_files_a_clone_has():
    files, folders = tracked()
    assert named_paths("[a](design.md), ![b](../results/x.png), `experiments/sweep.py`", "docs") == {
        "docs/design.md", "results/x.png", "experiments/sweep.py"}
    missing = {}
    for doc in sorted((REPO / "docs").glob("*.md")):
        paths = named_paths(doc.read_text(), "docs")
        missing[doc.name] = sorted(p for p in paths if p not in files and p not in folders and not p.startswith(GENERATED))
    missing = {name: paths for name, paths in missing.items() if paths}
    assert not missing, f"docs/ names paths a fresh clone lacks: {missing}"
