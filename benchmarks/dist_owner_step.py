"""Owner-side optimizer step of distributed Muon with simulated owners on one GPU, vs fused AdamW in the same run.

For each simulated world size W the owner plan (`megatron_muon.distributed.plan_owners`, costs from a startup
profile on this device) splits the reference model's Newton–Schulz matrices (hybrid-1.5B, fused QKV / GDN in_proj
split per section) among W data-parallel owners. Each owner's share (momentum + one batched orthogonalize per shape
bucket, exactly what `OwnerMuon` runs) is timed on its own; the step's critical path is the slowest owner plus the
local update every rank applies to its parameters, plus the fused AdamW step over the non-matrix rest. Collectives
are not simulated (one GPU): the reduce-scatter of gradients to owners and the all-gather of updates come on top;
the table gives the bytes each rank moves for them under the plan (ring model, padding included) next to the
all-reduce path, and the measured single-rank cost of packing gradients into the owner-ordered buffer and back
(`OwnerReduceScatter` on a one-rank group: the copies DDP's in-place all-reduce does not need).

    python benchmarks/dist_owner_step.py --out benchmarks/results/dist_owner_step.md
    python benchmarks/dist_owner_step.py --scale 32 --repeats 2 --worlds 1 2   # CPU smoke test of the script
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections import defaultdict
from pathlib import Path

import torch

from bench_env import emit_markdown  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from optimizer_step import reference_params, timed  # noqa: E402

from megatron_muon.distributed import AnalyticCost, MatrixSpec, plan_owners  # noqa: E402
from megatron_muon.distributed.grad_reduce import OwnerReduceScatter  # noqa: E402
from megatron_muon.distributed.comm import CommCounter  # noqa: E402
from megatron_muon.distributed.profile import profiled_cost  # noqa: E402
from megatron_muon.optimizer import Muon, muon_math  # noqa: E402
from megatron_muon.optimizer.routing import matrix_layout, piece_as_matrices, piece_views  # noqa: E402

NS = dict(ns_steps=5, coefficients="quintic", method="auto")
MOMENTUM, LR, WEIGHT_DECAY = 0.95, 0.02, 0.1


def ns_units(matrices):
    """(param index, full gradient of one orthogonalized matrix) for every piece of every parameter."""
    units = []
    for index, param in enumerate(matrices):
        layout = matrix_layout(param)
        for piece in piece_views(param.grad, layout):
            for matrix in piece_as_matrices(piece):
                units.append((index, matrix.contiguous()))
    return units


def owner_step_fn(grads, buffers):
    """What one owner runs per step: foreach momentum, then one orthogonalize per shape bucket."""
    buckets = defaultdict(list)
    for i, grad in enumerate(grads):
        buckets[tuple(grad.shape)].append(i)

    @torch.no_grad()
    def step():
        updates = muon_math.momentum_update_(grads, buffers, MOMENTUM, True)
        for members in buckets.values():
            muon_math.orthogonal_update(torch.stack([updates[i] for i in members]), **NS)

    return step


def traffic_bytes(units, owners, world: int) -> tuple[float, float]:
    """Bytes one rank moves per step for the Muon gradients and updates, ring collectives, one bucket group:
    (all-reduce of gradients + update all-gather, owner reduce-scatter + update all-gather)."""
    if world == 1:
        return 0.0, 0.0
    size = units[0][1].element_size()
    total = sum(g.numel() for _, g in units) * size
    per_rank = [0] * world
    for (_, grad), owner in zip(units, owners):
        per_rank[owner] += grad.numel() * size
    padded = max(per_rank) * world
    ring = (world - 1) / world
    return 2 * ring * total + ring * padded, 2 * ring * padded


def pack_unpack_ms(units, device, warmup: int, repeats: int) -> float:
    """Single-rank cost of the owner-ordered gradient buffer: pack, a one-rank reduce-scatter, unpack."""
    import torch.distributed as dist

    from megatron_muon.testing.pool import free_port

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}")
    views = [grad for _, grad in units]
    reduce = OwnerReduceScatter(views, [0] * len(views), dist.group.WORLD, CommCounter())

    def step():
        reduce.launch()
        reduce.finish()

    return timed(step, device, warmup, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension (CPU smoke tests)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--cost", choices=("profile", "flops"), default="profile")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="markdown result file")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    matrices, rest = reference_params(device, args.scale)
    fused = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    adamw_all = timed(torch.optim.AdamW(matrices + rest, lr=1e-4, weight_decay=0.1, **fused).step, device,
                      args.warmup, args.repeats)
    adamw_rest = timed(torch.optim.AdamW(rest, lr=1e-4, **fused).step, device, args.warmup, args.repeats)
    muon_single = timed(Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY, scale_mode="spectral").step, device,
                        args.warmup, args.repeats)
    print(f"fused AdamW all {adamw_all:.2f} ms, rest {adamw_rest:.2f} ms; single-process Muon {muon_single:.2f} ms")

    units = ns_units(matrices)
    shapes = {tuple(g.shape) for _, g in units}
    cost = profiled_cost(shapes, device=device) if args.cost == "profile" else AnalyticCost()
    updates = [torch.randn_like(p) * 1e-3 for p in matrices]

    weights = [p.data for p in matrices]

    def apply_step():  # every rank: weight decay and the update on all of its (data-parallel replicated) matrices
        muon_math.apply_weight_decay_(weights, lr=LR, weight_decay=WEIGHT_DECAY, mode="decoupled")
        muon_math.apply_updates_(weights, updates, lr=LR, scale=1.0)

    apply_ms = timed(apply_step, device, args.warmup, args.repeats)
    pack_ms = pack_unpack_ms(units, device, args.warmup, args.repeats)
    print(f"owner-ordered gradient buffer, pack + unpack on one rank: {pack_ms:.2f} ms", flush=True)
    rows = []
    for world in args.worlds:
        specs = [MatrixSpec(f"u{i}", tuple(g.shape), tuple(range(world))) for i, (_, g) in enumerate(units)]
        plan = plan_owners(specs, cost)
        owner_ms = []
        for rank in range(world):
            grads = [units[i][1] for i, owner in enumerate(plan.owners) if owner == rank]
            if not grads:
                owner_ms.append(0.0)
                continue
            buffers = [torch.zeros_like(g) for g in grads]
            owner_ms.append(timed(owner_step_fn(grads, buffers), device, args.warmup, args.repeats))
            del buffers
        slowest = max(owner_ms)
        total = slowest + apply_ms + adamw_rest
        all_reduce_bytes, owner_bytes = traffic_bytes(units, plan.owners, world)
        rows.append((world, plan.method, slowest, sum(owner_ms) / world, plan.makespan * 1e3, total,
                     total / adamw_all, total / (adamw_all / world), all_reduce_bytes / 2**30, owner_bytes / 2**30))
        print(f"W={world}: slowest owner {slowest:.2f} ms ({plan.method}), step {total:.2f} ms", flush=True)

    table = ["| simulated owners W | plan | slowest owner ms | mean owner ms | predicted ms | owner-side step ms "
             "(slowest + apply + AdamW rest) | × fused AdamW (all params) | × AdamW/W (ZeRO-sharded AdamW) "
             "| GiB/rank all-reduce path | GiB/rank owner path |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {w} | {m} | {s:.2f} | {a:.2f} | {p:.2f} | {t:.2f} | {r:.2f} | {z:.2f} | {ar:.3f} | {ow:.3f} |"
              for w, m, s, a, p, t, r, z, ar, ow in rows]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    header = [
        "# Distributed Muon, owner side, simulated owners on one device (hybrid-1.5B shape set)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- device: {gpu}; torch {torch.__version__}, Triton {triton_version}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {len(units)} orthogonalized matrices from {len(matrices)} parameters (scale 1/{args.scale}); "
        f"cost model: {args.cost}; median of {args.repeats} after {args.warmup} warm-up steps",
        f"- same run: fused AdamW all params {adamw_all:.2f} ms, non-matrix rest {adamw_rest:.2f} ms; "
        f"single-process Muon (all matrices) {muon_single:.2f} ms; local apply (decay + update) {apply_ms:.2f} ms",
        f"- owner-ordered gradient buffer (pack + one-rank reduce-scatter + unpack), measured: {pack_ms:.2f} ms; "
        "on W ranks it precedes the reduce-scatter (overlapping backward with overlap_grad_reduce)",
        "- not timed (one device): the collectives. GiB/rank columns: Muon gradients + updates per rank and step, "
        "ring model, all-reduce path = all-reduce + update all-gather, owner path = reduce-scatter to owners + "
        "update all-gather (padded to the plan's largest owner share); the update all-gather is launched per "
        "owner bucket and overlaps the remaining orthogonalizations and the weight decay",
        "",
    ]
    emit_markdown(header + table, args.out)


if __name__ == "__main__":
    main()
