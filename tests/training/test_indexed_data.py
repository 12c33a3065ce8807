"""--data-path trains on a Megatron indexed dataset (.bin/.idx) through megatron's GPTDataset."""

import numpy
import torch

from megatron_muon.training.report import read_jsonl


def _write_dataset(prefix: str, vocab_size: int, documents: int) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    docs = []
    for _ in range(documents):
        start, length = int(rng.integers(0, vocab_size - 1)), int(rng.integers(20, 80))
        doc = [(start + i) % (vocab_size - 1) for i in range(length)] + [vocab_size - 1]  # counting, then EOD
        builder.add_document(torch.tensor(doc), [len(doc)])
        docs.append(doc)
    builder.finalize(prefix + ".idx")
    return docs


def _train_on_indexed_data(rank, world_size, tmp):
    from megatron_muon.training.data import MicroBatches, build_train_dataset
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.loop import pretrain
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    prefix = f"{tmp}/corpus_text_document"
    if rank == 0:
        docs = _write_dataset(prefix, vocab_size=256, documents=200)
    torch.distributed.barrier()
    recipe = validate(load_recipe("tiny-cpu", [
        f"data.path=[{prefix}]", "training.train_iters=12", "training.micro_batch_size=2",
        "training.global_batch_size=4", "model.seq_length=32", "optimizer.lr_warmup_iters=1",
        "logging.log_interval=4", "logging.plot=false", f"logging.output_dir={tmp}/run",
    ]), world_size)
    init_parallel_state(1, 1)
    summary = pretrain(recipe, current_context())
    dataset = build_train_dataset(recipe, f"{tmp}/run")  # collective: every rank builds (from the cache now)
    if rank != 0:
        return summary, None
    # Every sample is a window of the concatenated (shuffled) documents: consecutive tokens count up unless an EOD
    # ends a document, which the counting pattern makes checkable without knowing the shuffle.
    batch = next(MicroBatches(dataset, 2, 4, 0, 2, torch.device("cpu")).for_step(0))
    tokens = batch["tokens"]
    steps = (tokens[:, 1:] - tokens[:, :-1]) % 255
    after_eod = tokens[:, :-1] == 255
    consistent = bool(((steps == 1) | after_eod | (tokens[:, 1:] == 255)).all())
    return summary, {"consistent": consistent, "labels_shifted": bool((batch["labels"][:, :-1] == tokens[:, 1:]).all()),
                     "document_tokens": sum(len(d) for d in docs)}


def test_pretrain_on_indexed_dataset(rank_pool_2, tmp_path):
    results = rank_pool_2.run(_train_on_indexed_data, str(tmp_path))
    (summary, check), _ = results
    assert check["consistent"] and check["labels_shifted"]
    steps = [r for r in read_jsonl(tmp_path / "run" / "train_log.jsonl") if r["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert list((tmp_path / "run" / "data_cache").glob("*.npy"))  # megatron's sample indices, cached in the run
