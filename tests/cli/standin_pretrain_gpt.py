"""A small stand-in for Megatron-LM's pretrain_gpt.py (Megatron-LM itself is not on PyPI).

It drives the same megatron APIs the real script uses at megatron-core 0.19.x: `parse_and_validate_args`,
`gpt_config_from_args` (which honours `--spec module name`), `pretrain_cfg_container_from_args`, megatron's mock
GPT datasets and `megatron.training.pretrain`. The only addition: it writes which optimizer classes megatron built
and which decoder layer classes the model has to $STANDIN_REPORT, so a test can see what `--optimizer` and `--spec`
selected.
"""

import json
import os
from functools import partial

import torch

import megatron.training.training as megatron_training
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

REPORT = {}
BUILT = []  # the optimizers megatron built, for what only a step fills in (Muon's bucket plan)
if os.environ.get("TRITON_INTERPRET") == "1":  # the plugin's Triton passes run under the interpreter on CPU
    from tests.interpreter import patch_for_numpy_2_5

    patch_for_numpy_2_5()
_build_optimizer = megatron_training.get_megatron_optimizer


def _recording_optimizer_builder(config, model_chunks, *args, **kwargs):
    optimizer = _build_optimizer(config, model_chunks, *args, **kwargs)
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    REPORT["optimizer_classes"] = [
        f"{type(getattr(p, 'optimizer', p)).__module__}.{type(getattr(p, 'optimizer', p)).__qualname__}" for p in parts
    ]
    REPORT["optimizer_name"] = config.optimizer
    REPORT["fast_paths"] = getattr(optimizer, "megatron_muon_fast_paths", None)
    decoder = model_chunks[0].module.module.decoder if hasattr(model_chunks[0].module, "module") else None
    if decoder is None:
        decoder = model_chunks[0].module.decoder
    REPORT["mixers"] = [type(layer.self_attention).__name__ for layer in decoder.layers]
    REPORT["ddp_check_for_nan_in_grad"] = getattr(getattr(model_chunks[0], "ddp_config", None),
                                                  "check_for_nan_in_grad", None)
    REPORT["nonfinite_checks"] = [p.nonfinite_check for p in parts if hasattr(p, "nonfinite_check")]
    BUILT.extend(getattr(p, "optimizer", p) for p in parts)
    return optimizer


megatron_training.get_megatron_optimizer = _recording_optimizer_builder


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].cuda(), batch["labels"].cuda()
    loss_mask, position_ids = batch["loss_mask"].cuda(), batch["position_ids"].cuda()
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.view(-1).float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        REPORT.setdefault("losses", []).append(float(loss / num_tokens))
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, split=args.split,
        tokenizer=build_tokenizer(args), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, lambda: mpu.get_tensor_model_parallel_rank() == 0, config
    ).build()


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(full_config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    plans = [inner._plan_cache[1] for inner in BUILT if getattr(inner, "_plan_cache", None)]
    REPORT["muon_bucket_shapes"] = sorted({tuple(bucket.shape) for plan in plans for bucket in plan.buckets})
    if torch.distributed.get_rank() == 0 and os.environ.get("STANDIN_REPORT"):
        with open(os.environ["STANDIN_REPORT"], "w") as report:
            json.dump(REPORT, report)
