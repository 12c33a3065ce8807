"""dist_sim_step's batch arguments: --global-batch gives every W the same number of sequences per step (global
batch / W micro-batches per rank) and refuses a batch that some W does not divide, naming the rule."""

import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from dist_sim_step import _batch_words, main, micro_batches_per_rank  # noqa: E402


def test_a_global_batch_is_shared_out_over_the_ranks():
    args = Namespace(micro_batches=3, global_batch=128)
    assert [micro_batches_per_rank(args, w) for w in (4, 8)] == [32, 16]
    assert micro_batches_per_rank(Namespace(micro_batches=3, global_batch=None), 8) == 3
    assert "global batch of 128" in _batch_words({"global_batch": 128, "micro_batches": 1})
    assert _batch_words({"micro_batches": 2}) == "2 micro-batch(es)"


@pytest.mark.parametrize("global_batch", ["12", "2"])
def test_a_global_batch_that_a_world_size_does_not_divide_is_refused(global_batch):
    with pytest.raises(SystemExit, match="multiple of every --world"):
        main(["--cpu", "--world", "4", "8", "--global-batch", global_batch])
