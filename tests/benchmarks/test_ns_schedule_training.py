"""The schedule-training benchmark (benchmarks/ns_schedule_training.py): its argument checks, its summary
arithmetic, and a tiny CPU run of two schedules through the package's pretrain loop on standard-library text."""

import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from ns_schedule_training import parse_schedules, parse_seeds, stdlib_corpus, variant_recipe  # noqa: E402
from ns_schedule_training_report import summarize  # noqa: E402


def test_schedules_and_seeds_are_checked_with_the_fix_named():
    assert parse_schedules("simple:5, cans:4") == [("simple", 5), ("cans", 4)]
    assert parse_schedules("simple:5,simple+heads:5") == [("simple", 5), ("simple+heads", 5)]
    with pytest.raises(ValueError, match="must include simple:5"):
        parse_schedules("polar_express:4")
    with pytest.raises(ValueError, match="NAME:STEPS or NAME[+]heads:STEPS with NAME one of"):
        parse_schedules("simple:5,polar:4")
    with pytest.raises(ValueError, match="twice"):
        parse_schedules("simple:5,simple:5")
    assert parse_seeds("1,2") == [1, 2]
    with pytest.raises(ValueError, match="comma list of integers"):
        parse_seeds("1,x")


def test_set_may_not_change_what_the_variants_vary(tmp_path):
    with pytest.raises(ValueError, match="choose it with --schedules"):
        variant_recipe("tiny", "gpt", ("simple", 5), 1, "unused", tmp_path, ["optimizer.muon_num_ns_steps=3"])


def test_a_heads_schedule_splits_heads_with_the_same_coefficients(tmp_path):
    from ns_schedule_training_report import label

    prefix = tmp_path / "text"
    for suffix in (".bin", ".idx"):  # validation checks that the dataset's files exist
        prefix.with_suffix(suffix).touch()
    heads = variant_recipe("tiny", "hybrid", ("polar_express+heads", 4), 1, str(prefix), tmp_path, [])
    whole = variant_recipe("tiny", "hybrid", ("polar_express", 4), 1, str(prefix), tmp_path, [])
    assert heads.optimizer.muon_split_heads and not whole.optimizer.muon_split_heads
    assert heads.optimizer.muon_coefficient_type == whole.optimizer.muon_coefficient_type == "polar_express"
    assert heads.logging.output_dir != whole.logging.output_dir
    assert label("polar_express+heads", 4) == "polar_express×4 per head"


def test_the_validation_split_is_other_files_chosen_by_name():
    corpus = stdlib_corpus(stride=16)
    assert corpus["train_files"] and corpus["valid_files"]
    assert not set(corpus["train_files"]) & set(corpus["valid_files"])
    assert corpus["train_files"] == sorted(corpus["train_files"])
    assert not any("site-packages" in name for name in corpus["train_files"])
    assert stdlib_corpus(stride=16)["fingerprint"] == corpus["fingerprint"]


def test_differences_are_in_units_of_the_pooled_seed_spread():
    def run(schedule, steps, seed, loss):
        return {"kind": "gpt", "schedule": schedule, "steps": steps, "seed": seed, "final_train_loss": loss,
                "valid_loss": loss, "step_ms": 1.0, "optimizer_share": 0.5}

    runs = [run("simple", 5, 1, 1.0), run("simple", 5, 2, 1.2), run("cans", 4, 1, 1.3), run("cans", 4, 2, 1.5)]
    base, cans = summarize(runs)
    assert base["valid_loss"]["delta"] == 0 and cans["valid_loss"]["delta"] == pytest.approx(0.3)
    assert cans["valid_loss"]["delta_sigma"] == pytest.approx(0.3 / math.sqrt(0.02))  # both sd 0.1414
    assert cans["valid_loss"]["paired_deltas"] == pytest.approx([0.3, 0.3])


def _tiny_run(rank, world_size, tmp):
    from ns_schedule_training import build_parser, run_benchmark

    from megatron_muon.training.distributed import current_context, init_parallel_state

    init_parallel_state(1, 1)
    argv = ["--tiny", "--schedules", "simple:5,polar_express:4", "--kinds", "gpt", "--seeds", "1",
            "--out", f"{tmp}/out/ns.md", "--work-dir", f"{tmp}/work"]
    first = run_benchmark(build_parser().parse_args(argv), current_context(), "first")
    again = run_benchmark(build_parser().parse_args([*argv, "--append"]), current_context(), "again")
    return first, again


def test_tiny_cpu_run_of_two_schedules(rank_pool_1, tmp_path):
    """Both runs start from the same weights and batches (equal first loss), the schedule changes the curve, losses
    are finite and fall, the validation loss comes from the loop's evaluate hook, and --append reuses the runs."""
    (first, again), = rank_pool_1.run(_tiny_run, str(tmp_path))
    out = tmp_path / "out"
    table = (out / "ns.md").read_text()
    assert "| gpt | simple×5 |" in table and "| gpt | polar_express×4 |" in table and "— (the unit)" in table
    rows = json.loads((out / "ns.json").read_text())["rows"]
    assert [(r["schedule"], r["steps"]) for r in rows] == [("simple", 5), ("polar_express", 4)]
    runs = json.loads((out / "ns_curves.json").read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        losses = run["loss"]
        assert len(losses) == run["recipe"]["training"]["train_iters"] == 20
        assert all(math.isfinite(x) for x in losses) and math.isfinite(run["valid_loss"])
        assert run["final_train_loss"] < 0.8 * losses[0] and run["valid_loss"] < 0.8 * losses[0]
    simple, polar = runs
    assert simple["loss"][0] == polar["loss"][0] and simple["loss"] != polar["loss"]
    assert simple["recipe"]["optimizer"]["muon_num_ns_steps"] == 5 and polar["recipe"]["optimizer"][
        "muon_coefficient_type"] == "polar_express"
    end = [json.loads(line) for line in (tmp_path / "work" / "gpt_simple5_seed1" / "train_log.jsonl").read_text()
           .splitlines()][-1]
    assert end["event"] == "end" and end["valid_loss"] == simple["valid_loss"]
    assert again["runs"] == first["runs"] and again["meta"]["commands"] == ["first", "again"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "ns_curves.png").stat().st_size > 0
