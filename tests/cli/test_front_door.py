"""The command line as a Megatron-LM user meets it: hints for Megatron habits, recipe keys, one-sentence errors, a
GPU recipe refused on a CPU machine in seconds, text prepared into an indexed dataset and trained on."""

import json
import time
from pathlib import Path

import pytest

from megatron_muon.cli.main import main


@pytest.fixture
def lone_process(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-muon: error: ") and len(err.splitlines()) == 1, err
    return err


def test_a_megatron_flag_gets_the_recipe_key_that_means_it(lone_process, capsys):
    assert main(["pretrain", "--optimizer", "adam"]) == 2
    err = _error(capsys)
    assert "--optimizer is a Megatron-LM flag" in err and "--set optimizer.name=VALUE" in err
    assert "megatron_muon.launch" in err
    assert main(["pretrain", "--frobnicate"]) == 2
    assert "unrecognized arguments: --frobnicate" in _error(capsys)


def test_help_points_to_the_recipe_keys_and_keys_lists_them(capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "megatron-muon keys" in capsys.readouterr().out
    assert main(["keys"]) == 0
    listed = capsys.readouterr().out
    for key in ("optimizer.lr", "checkpoint.load_iteration", "checkpoint.override_lr_schedule", "data.path"):
        assert key in listed


def test_report_on_a_missing_or_malformed_log_says_so_in_one_sentence(lone_process, capsys):
    assert main(["report", str(lone_process / "nothing.jsonl")]) == 2
    assert "no log at" in _error(capsys)
    bad = lone_process / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["report", str(bad)]) == 2
    assert "is not a pretrain log" in _error(capsys)


def test_a_gpu_recipe_on_a_machine_without_a_gpu_is_refused_in_seconds(lone_process, capsys):
    start = time.perf_counter()
    assert main(["pretrain", "--recipe", "hybrid-1.5b-h200"]) == 2
    assert time.perf_counter() - start < 30
    err = _error(capsys)
    assert "1.48B-parameter model sized for GPUs" in err and "--recipe tiny-cpu" in err
    assert list(lone_process.iterdir()) == []


def test_a_warmup_as_long_as_the_run_is_refused(lone_process, capsys):
    assert main(["pretrain", "--set", "training.train_iters=10", "--set", "optimizer.lr_warmup_iters=10"]) == 2
    assert "must be at least 0 and below the decay length (10" in _error(capsys)


def test_prepare_data_from_jsonl_and_text_with_the_byte_tokenizer(lone_process, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (lone_process / "a.jsonl").write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "ab"}) + "\n")
    (lone_process / "b.txt").write_text("plain text\n")
    prefix = str(lone_process / "corpus")
    assert main(["prepare-data", "--input", "a.jsonl", "b.txt", "--output-prefix", prefix]) == 0
    assert f"--data-path {prefix} --set model.vocab_size=256 --set data.eod_id=255" in capsys.readouterr().out
    dataset = IndexedDataset(prefix)
    documents = [list(dataset[i]) for i in range(len(dataset))]
    assert documents == [list("héllo".encode()) + [255], [97, 98, 255], list(b"plain text\n") + [255]]
    meta = json.loads(Path(prefix + ".meta.json").read_text())
    assert meta == {"tokenizer": "byte", "vocab_size": 256, "eod_id": 255, "documents": 3,
                    "tokens": sum(map(len, documents))}
    (lone_process / "c.jsonl").write_text('{"body": "x"}\n')
    assert main(["prepare-data", "--input", "c.jsonl", "--output-prefix", prefix + "2"]) == 2
    assert "c.jsonl:1 has no 'text' field; name the text field with --json-key" in _error(capsys)


def test_prepare_data_with_a_hugging_face_tokenizer_and_the_vocab_check(lone_process, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron_muon.training.corpus import DataError, check_token_ids

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the cat sat on the mat"] * 3,
                                  trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tokenizer.save(str(lone_process / "tokenizer.json"))
    (lone_process / "t.txt").write_text("the cat sat")
    prefix = str(lone_process / "words")
    assert main(["prepare-data", "--input", "t.txt", "--output-prefix", prefix, "--tokenizer",
                 str(lone_process / "tokenizer.json")]) == 0
    meta = json.loads(Path(prefix + ".meta.json").read_text())
    assert meta["vocab_size"] == tokenizer.get_vocab_size() and meta["eod_id"] == tokenizer.token_to_id("</s>")
    check_token_ids([prefix], meta["vocab_size"], meta["eod_id"])
    with pytest.raises(DataError, match=rf"holds token ids up to {meta['vocab_size'] - 1} but model.vocab_size is 3"):
        check_token_ids([prefix], 3, meta["eod_id"])
    with pytest.raises(DataError, match=rf"add --set data.eod_id={meta['eod_id']}"):
        check_token_ids([prefix], 64, 63)
    (Path(prefix + ".meta.json")).unlink()  # a dataset written elsewhere: its ids are read instead
    with pytest.raises(DataError, match="holds token ids up to"):
        check_token_ids([prefix], 3, meta["eod_id"])


def _train_on(rank, world_size, prefix, output_dir):
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.loop import pretrain
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    recipe = validate(load_recipe("tiny-cpu", [
        f"data.path=[{prefix}]", "training.train_iters=20", "training.micro_batch_size=4",
        "training.global_batch_size=4", "model.seq_length=64", "optimizer.lr_warmup_iters=2",
        "logging.log_interval=5", "logging.plot=false", "logging.progress_bar=false", f"logging.output_dir={output_dir}",
    ]), world_size)
    init_parallel_state(1, 1)
    return pretrain(recipe, current_context())


def test_text_prepared_with_the_byte_tokenizer_trains(rank_pool_1, lone_process):
    import megatron.core

    from megatron_muon.training.report import read_jsonl

    corpus = Path(megatron.core.__file__).parent / "optimizer" / "optimizer.py"  # real text that ships with megatron
    prefix = str(lone_process / "code")
    assert main(["prepare-data", "--input", str(corpus), "--output-prefix", prefix]) == 0
    rank_pool_1.run(_train_on, prefix, str(lone_process / "run"))
    records = read_jsonl(lone_process / "run" / "train_log.jsonl")
    losses = [r["loss"] for r in records if r["event"] == "step"]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert any(note.startswith("MFU n/a: no peak FLOP/s is known for cpu") for note in records[0]["notes"])
    assert all(r["loss_steps"] == 5 for r in records if r["event"] == "step")


def test_the_console_line_says_the_loss_is_a_window_mean():
    from megatron_muon.training.report import format_step

    record = {"step": 10, "loss": 2.0, "loss_steps": 10, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": None,
              "mfu_all_sdpa": None, "optimizer_share": 0.1, "memory_gib": 1.0}
    assert "loss 2.0000 (mean of 10 steps)" in format_step(record, 20)
