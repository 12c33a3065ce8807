"""Our spec on Transformer Engine's modules, compiled layer by layer on the GPU: it trains (the first forward used to
crash in Inductor after megatron's viewless copy of a TE linear's view output), and its losses follow the eager TE
run's within bf16 tolerance. With TE's compiled path on (a torch that TE's custom ops support), the compiled model has
no graph break and no recompile; where TE reports that path off, its modules break the graph and that part is an
expected failure with TE's reason."""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.training.te_cudnn import transformer_engine_compile_disabled, transformer_engine_usable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not transformer_engine_usable(),
                                 reason="needs Transformer Engine (pip install megatron-muon[te])")]


def test_our_te_spec_trains_compiled_like_eager(tmp_path):
    from e2e import main

    out = tmp_path / "e2e.md"
    small = ["model.num_layers=4", "model.seq_length=2048", "model.vocab_size=4096", "optimizer.clip_grad=0.0"]
    main(["--recipe", "hybrid-1.5b-h200", "--rungs", "4te-e,4te", "--steps", "6", "--warmup", "2",
          *[arg for item in small for arg in ("--set", item)], "--out", str(out), "--data-dir", str(tmp_path / "d")])
    rows = {r["rung"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert all("error" not in row for row in rows.values()), rows
    eager, compiled = rows["4te-e"]["losses"], rows["4te"]["losses"]
    assert eager[-1] < eager[0]
    # bf16 with different fusions: eager and compiled agree to ~1e-4 relative while the loss is large; once the
    # mock batches are memorized (loss ~0.08 from 8.7) the last steps differ by ~2e-3 absolute, so the absolute
    # bound is 1e-3 of the first loss
    assert compiled == pytest.approx(eager, rel=1e-2, abs=1e-3 * eager[0]), (eager, compiled)
    reason = transformer_engine_compile_disabled()
    if reason is not None:
        # TE runs each module eager under torch.compile: every call breaks its layer's graph, and the frames resumed
        # after the breaks recompile per layer kind and shape
        assert rows["4te"]["graph_breaks"] > 0
        pytest.xfail(f"Transformer Engine's compiled path is off here ({reason}): its modules break the graph")
    assert rows["4te"]["graph_breaks"] == 0, rows["4te"]
    assert rows["4te"]["recompiles"] == 0, rows["4te"]["recompile_reasons"]
