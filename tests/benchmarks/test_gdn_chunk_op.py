"""The chunk-op benchmark (`gdn.py --chunk-op`) end to end on CPU at tiny sizes, its profile table included, and the
per-stage kernel variants it times on a GPU."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gdn_chunk_op import STAGE_VARIANTS  # noqa: E402


def test_chunk_op_benchmark_smoke_with_profile(tmp_path):
    out = tmp_path / "chunk.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "gdn.py"), "--tiny", "--chunk-op", "--device", "cpu", "--reps",
                    "1", "--warmup", "0", "--profile", "--profile-top", "3", "--out", str(out)], check=True,
                   cwd=BENCHMARKS.parent, timeout=600, capture_output=True)
    text = out.read_text()
    assert "| ours chunk op |" in text
    assert "| ours chunk op (recomputing its chunk states) |" in text
    assert "### Where the time goes: ours chunk op (top 3" in text
    assert "| function | calls/step | self ms/step | cumulative ms/step |" in text  # the Python side
    assert "(states: fla)" not in text  # the per-stage variants choose CUDA kernels: GPU only


def test_stage_variants_each_change_one_choice_from_a_variant_timed_before_or_all():
    from megatron_muon.ops.kernel_choice import PRESETS, GdnKernels

    default = GdnKernels()
    assert default == PRESETS["ours"]

    def changed(kernels, base):
        return [stage for stage in ("states", "output_grads", "output_terms", "intra")
                if getattr(kernels, stage) != getattr(base, stage)]

    timed_before = [default]
    for suffix, kernels in STAGE_VARIANTS:
        one_change = any(len(changed(kernels, base)) == 1 for base in timed_before)
        assert one_change or kernels == PRESETS["fla"], suffix
        timed_before.append(kernels)
    assert len({kernels for _, kernels in STAGE_VARIANTS}) == len(STAGE_VARIANTS)


def test_report_shows_kernels_only_time_and_why_a_capture_failed(tmp_path):
    from argparse import Namespace

    from gdn import write_report
    from gdn_chunk_op import REFERENCE_VARIANT

    rows = [dict(name=REFERENCE_VARIANT, first_ms=9.0, ms=2.0, stream_ms=1.7, host_ms=1.4, graph_ms=1.6),
            dict(name="ours chunk op", first_ms=9.0, ms=4.0, stream_ms=3.5, host_ms=3.5, graph_ms=3.2),
            dict(name="fla chunk op", first_ms=9.0, ms=5.0, stream_ms=4.0, host_ms=3.0,
                 graph_error="RuntimeError: operation not permitted when stream is capturing")]
    meta = dict(date="d", device="gpu", versions={}, backend="b", sizes={}, command="c")
    args = Namespace(chunk_op=True, seq_len=16, reps=1, warmup=0)
    out = tmp_path / "r.md"
    write_report(out, rows, meta, args, echo=False)
    text = out.read_text()
    assert "| ours chunk op | 4.00 | 1.250x | 3.50 | 1.143x | 3.50 | 3.20 |" in text
    assert "| fla chunk op | 5.00 | 1.000x | 4.00 | 1.000x | 3.00 | - |" in text
    assert "Not captured in a CUDA graph (no kernels-only time): fla chunk op: RuntimeError: operation not" in text
    assert "Kernels only (each call replayed from a CUDA graph): 1.60 ms against 3.20, 0.500x." in text


def test_python_table_leaves_out_the_custom_op_dispatch_that_cprofile_counts_twice():
    """cProfile books torch's custom-op `backend_impl` the implementation's whole time as its own self time; the
    table leaves that row out of its rows and total and says so."""
    import time

    import torch
    from kernel_profile import python_table

    @torch.library.custom_op("megatron_muon_test::busy_clone", mutates_args=())
    def busy_clone(x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        while time.perf_counter() - start < 2e-3:
            pass
        return x.clone()

    x = torch.randn(3)
    busy_clone(x)  # first call: registration and imports out of the profile
    lines = python_table(lambda: busy_clone(x), "cpu", steps=3, top=50)
    rows = [line for line in lines if line.startswith("| `")]
    assert any("busy_clone" in row for row in rows)
    assert not any("backend_impl" in row for row in rows)
    assert "`backend_impl` left out" in lines[1]
