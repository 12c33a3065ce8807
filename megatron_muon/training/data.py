"""Training data through megatron-core's GPT datasets: mock by default, Megatron indexed datasets with --data-path.

Sample order is a pure function of (step, micro-batch, dp rank), so a resumed run reads exactly the samples the
uninterrupted run would have read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from megatron_muon.training.config import Recipe


def build_train_dataset(recipe: Recipe, output_dir: str | Path):
    """megatron's MockGPTDataset or GPTDataset (blend) with enough samples for train_iters x global_batch_size."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    data, model = recipe.data, recipe.model
    eod = data.eod_id if data.eod_id is not None else model.vocab_size - 1
    tokenizer = NullTokenizer(model.vocab_size, eod_id=eod)
    blend = get_blend_from_list(data.path) if data.path else None
    config = GPTDatasetConfig(
        random_seed=recipe.training.seed,
        sequence_length=model.seq_length,
        blend=blend,
        split=data.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=(data.cache_dir or str(Path(output_dir) / "data_cache")) if blend else None,
    )
    num_samples = recipe.training.train_iters * recipe.training.global_batch_size
    dataset_class = GPTDataset if blend else MockGPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(dataset_class, [num_samples, 0, 0], lambda: True, config).build()
    return train


class MicroBatches:
    """Micro-batches for this dp rank: step s, micro-batch m reads samples
    s*global + m*(micro*dp) + dp_rank*micro ... + micro - 1, so every dp size sees the same global batch."""

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 device: torch.device, start_step: int = 0):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device
        self.step = start_step
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)

    def for_step(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        for micro in range(self.num_microbatches):
            first = step * self.global_batch_size + micro * self.micro_batch_size * self.dp_size
            first += self.dp_rank * self.micro_batch_size
            samples = [self.dataset[first + i] for i in range(self.micro_batch_size)]
            yield {key: self._upload(torch.stack([s[key] for s in samples]))
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}

    def _upload(self, batch: torch.Tensor) -> torch.Tensor:
        """To the device without waiting for it: a copy from pageable memory would hold the CPU until the GPU
        reached it, so the next step's launches could not overlap the current step."""
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)
