"""The log's start record says which optimizer paths a run took."""

from megatron_muon.training.report import read_jsonl


def _start_record(rank, world_size, output_dir, one_pass):
    from megatron_muon.training import loop
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    recipe = validate(load_recipe("tiny-cpu", [
        "training.train_iters=1", "optimizer.lr_warmup_iters=0", "training.micro_batch_size=2",
        "training.global_batch_size=2",
        "model.seq_length=32", "training.precision=bf16", "optimizer.name=adam", f"optimizer.one_pass_adamw={one_pass}",
        "logging.plot=false", "logging.progress_bar=false", f"logging.output_dir={output_dir}",
    ]), world_size)
    init_parallel_state(1, 1)
    loop.pretrain(recipe, current_context())
    return read_jsonl(output_dir + "/train_log.jsonl")[0]


def test_the_start_record_says_whether_the_one_pass_adamw_runs(rank_pool_1, tmp_path):
    """On CPU tensors outside the Triton interpreter the pass never installs; switched off it is not even tried."""
    for one_pass in ("true", "false"):
        (start,) = rank_pool_1.run(_start_record, str(tmp_path / one_pass), one_pass)
        assert start["event"] == "start" and start["one_pass_adamw"] == 0
        assert start["recipe"]["optimizer"]["one_pass_adamw"] is (one_pass == "true")
