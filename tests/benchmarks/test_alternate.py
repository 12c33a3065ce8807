"""The alternating A/B script: table parsing, and two trees run in turn on CPU."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from alternate import main, parse_tree, per_unit, summarize, table_rows  # noqa: E402


def test_table_rows_take_the_label_before_the_first_number():
    markdown = "\n".join([
        "| method | shape (count) | ms | TFLOP/s |", "|---|---|---:|---:|",
        "| ours auto | fc1 (24) | 19.26 | 1284 |", "| ours auto | whole set (96) | 57.40 | 1105 |",
        "| fused AdamW, all params | 12.96 | 1.00 |", "- whole set: 57.40 ms", "| tokens/s | 45,524 |",
    ])
    assert table_rows(markdown) == {"ours auto / fc1 (24)": 19.26, "ours auto / whole set (96)": 57.40,
                                    "fused AdamW, all params": 12.96, "tokens/s": 45524.0}


def test_summary_has_medians_ranges_and_ratios():
    runs = {"a": [{"x": 10.0}, {"x": 12.0}, {"x": 11.0}], "b": [{"x": 5.0, "y": 1.0}, {"x": 6.0}, {"x": 5.5}]}
    lines = summarize(["a", "b"], runs)
    assert lines[2] == "| x | 11.00 (10.00–12.00) | 5.50 (5.00–6.00) | 0.500 |"
    assert lines[3] == "| y |  | 1.00 (1.00–1.00) |  |"


def test_rows_over_a_unit_take_each_run_against_its_own_unit():
    runs = {"a": [{"base": 10.0, "x": 40.0}, {"base": 20.0, "x": 60.0}], "b": [{"base": 16.0, "x": 40.0}]}
    ratios = per_unit(runs, "base")
    assert ratios == {"a": [{"base": 1.0, "x": 4.0}, {"base": 1.0, "x": 3.0}], "b": [{"base": 1.0, "x": 2.5}]}
    assert summarize(["a", "b"], ratios, digits=3)[3] == "| x | 3.500 (3.000–4.000) | 2.500 (2.500–2.500) | 0.714 |"
    with pytest.raises(SystemExit, match="names no row.*'base', 'x'"):
        per_unit(runs, "fused AdamW")


def test_bad_tree_arguments_name_the_fix(tmp_path):
    with pytest.raises(Exception, match="NAME=PATH"):
        parse_tree(str(tmp_path))
    with pytest.raises(Exception, match="not a directory"):
        parse_tree(f"x={tmp_path / 'missing'}")
    with pytest.raises(SystemExit, match="must differ"):
        main(["--trees", f"a={tmp_path}", f"a={tmp_path}", "--", "benchmarks/optimizer_step.py"])


def test_two_trees_alternate_on_cpu(tmp_path):
    root = BENCHMARKS.parent
    out = tmp_path / "ab.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "alternate.py"), "--trees", f"base={root}", f"same={root}",
                    "--rounds", "2", "--out", str(out), "--per", "fused AdamW, all params", "--",
                    "benchmarks/optimizer_step.py", "--scale", "128",
                    "--warmup", "0", "--repeats", "1", "--only-ours"], check=True, cwd=root, timeout=600)
    text = out.read_text()
    assert "| ours (auto, MegaBatch, fused splits) |" in text
    assert "- 2 rounds, trees in this order each round" in text and "| row | base: median (min–max)" in text
    assert "same / base" in text and "round 1/2" not in text  # progress lines go to stdout only
    per_run = text.split('Each row over "fused AdamW, all params" of the same run')[1]
    assert "| fused AdamW, all params | 1.000 (1.000–1.000) | 1.000 (1.000–1.000) | 1.000 |" in per_run
    assert "| ours (auto, MegaBatch, fused splits) |" in per_run
