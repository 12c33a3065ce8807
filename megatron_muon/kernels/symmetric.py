"""Triton kernel for symmetric products: out = alpha·A·Bᵀ + beta·C when the result is known to be symmetric.

Covers X·Xᵀ (B = A), b·R + c·R² (B = C = R) and products of commuting symmetric matrices (Q·Z, R·Z). Only the
tiles on and below the diagonal are computed; each off-diagonal tile is stored twice (itself and its mirror), so
the products cost about half a GEMM. Batched over dim 0; every offset is computed in int64 (pointers) or by the
hardware (TMA) so a batch whose elements start beyond 2³¹ elements indexes correctly. Memory is accessed through
pointers or, on Hopper, through the tensor-memory accelerator (TMA: A, B and C loaded, both stored tiles written
asynchronously from shared memory), and TMA configs may be persistent (one program per SM looping over the batch's
tiles, so a tile's loads overlap the previous tile's stores); the autotuner picks per (rows, inner dim). TMA stores
matter most: the transposed pointer store of the mirror tile made the epilogue a large share of a product's time
(docs/design/newton_schulz.md). A fixed small config under TRITON_INTERPRET=1 (CPU debugging).
On Hopper, `TritonOps.sym_mm` prefers the Gluon kernels (`HOPPER_KERNELS`, in order) wherever they apply.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from megatron_muon.kernels import scaled_copy as scaled_copy_kernel
from megatron_muon.kernels import symmetric_wide, symmetric_ws
from megatron_muon.kernels.ops import TorchOps, sm_count
from megatron_muon.kernels.triton_math import INTERPRETING


@triton.jit
def _lower_tile_coordinates(pid):
    """Linear index over the lower-triangular tiles -> (row tile i, col tile j) with j <= i, in pid's int type."""
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(pid.dtype)
    # float rounding can land one off; correct both ways.
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _batched_lower_tile(tile, per_matrix):
    """Linear tile index over a batch of lower triangles -> (batch element, row tile, col tile)."""
    tile_i, tile_j = _lower_tile_coordinates(tile % per_matrix)
    return tile // per_matrix, tile_i, tile_j


@triton.jit
def _persistent_tma_tiles(a_desc, b_desc, c_desc, o_desc, M, K, batch_count, alpha, beta, out_dtype: tl.constexpr,
                          HAS_C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr):
    """Each program loops over every NUM_SMS-th tile of the whole batch. The flattened loop lets the next tile's
    loads start while this tile's TMA stores drain; the epilogue takes its coordinates from its own counter, and a
    diagonal tile's mirror box is placed past the last row (TMA writes nothing there), so no branch splits the
    loop body."""
    tiles = tl.cdiv(M, BLOCK)
    per_matrix = tiles * (tiles + 1) // 2
    stored = tl.program_id(0) - NUM_SMS
    for tile in tl.range(tl.program_id(0), per_matrix * batch_count, NUM_SMS, flatten=True):
        batch, tile_i, tile_j = _batched_lower_tile(tile, per_matrix)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([batch, tile_i * BLOCK, k0]).reshape(BLOCK, BLOCK_K)
            b = b_desc.load([batch, tile_j * BLOCK, k0]).reshape(BLOCK, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
        stored += NUM_SMS
        batch, tile_i, tile_j = _batched_lower_tile(stored, per_matrix)
        acc = acc * alpha
        if HAS_C:
            acc += beta * c_desc.load([batch, tile_i * BLOCK, tile_j * BLOCK]).reshape(BLOCK, BLOCK).to(tl.float32)
        result = acc.to(out_dtype)
        o_desc.store([batch, tile_i * BLOCK, tile_j * BLOCK], result.reshape(1, BLOCK, BLOCK))
        mirror_row = tl.where(tile_i != tile_j, tile_j * BLOCK, M)
        o_desc.store([batch, mirror_row, tile_i * BLOCK], tl.trans(result).reshape(1, BLOCK, BLOCK))


@triton.jit
def _sym_mm_kernel(
    A, B, a_desc, b_desc, C, Out, c_desc, o_desc,
    M, K, batch_count,
    stride_a_batch, stride_a_row, stride_a_col,
    stride_b_batch, stride_b_row, stride_b_col,
    stride_c_batch, stride_c_row, stride_c_col,
    stride_o_batch, stride_o_row, stride_o_col,
    alpha, beta,
    HAS_C: tl.constexpr,
    LOADS: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_SMS: tl.constexpr,
):  # fmt: skip
    """One lower-triangular tile per program, or with `PERSISTENT` (TMA only) one program per SM looping over tiles.
    `LOADS` (the access styles allowed) only keys the autotuner; `USE_TMA` (a config choice) reads A, B and C and
    writes Out through 3-D [batch, rows, cols] descriptors, which zero-fill loads and clip stores at every edge."""
    if PERSISTENT:
        _persistent_tma_tiles(a_desc, b_desc, c_desc, o_desc, M, K, batch_count, alpha, beta, Out.dtype.element_ty,
                              HAS_C, BLOCK, BLOCK_K, NUM_SMS)
    else:
        _tile(A, B, a_desc, b_desc, C, Out, c_desc, o_desc, M, K, stride_a_batch, stride_a_row, stride_a_col,
              stride_b_batch, stride_b_row, stride_b_col, stride_c_batch, stride_c_row, stride_c_col,
              stride_o_batch, stride_o_row, stride_o_col, alpha, beta, HAS_C, USE_TMA, BLOCK, BLOCK_K, EVEN)


@triton.jit
def _tile(
    A, B, a_desc, b_desc, C, Out, c_desc, o_desc, M, K,
    stride_a_batch, stride_a_row, stride_a_col,
    stride_b_batch, stride_b_row, stride_b_col,
    stride_c_batch, stride_c_row, stride_c_col,
    stride_o_batch, stride_o_row, stride_o_col,
    alpha, beta,
    HAS_C: tl.constexpr, USE_TMA: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """The lower-triangular tile (program_id(0), batch element program_id(1))."""
    pid = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    tile_i, tile_j = _lower_tile_coordinates(pid)
    rows = tile_i * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    cols = tile_j * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([batch.to(tl.int32), (tile_i * BLOCK).to(tl.int32), k0]).reshape(BLOCK, BLOCK_K)
            b = b_desc.load([batch.to(tl.int32), (tile_j * BLOCK).to(tl.int32), k0]).reshape(BLOCK, BLOCK_K)
            acc = tl.dot(a, b.T, acc)
    else:
        inner = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = A + batch * stride_a_batch + rows[:, None] * stride_a_row + inner[None, :] * stride_a_col
        b_ptrs = B + batch * stride_b_batch + cols[None, :] * stride_b_row + inner[:, None] * stride_b_col
        for k0 in range(0, K, BLOCK_K):
            if EVEN:  # no masks: lets the loads vectorize and pipeline
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = (k0 + inner) < K
                a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=(cols[None, :] < M) & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_a_col
            b_ptrs += BLOCK_K * stride_b_col

    acc = acc * alpha
    if USE_TMA:
        tile = [batch.to(tl.int32), (tile_i * BLOCK).to(tl.int32), (tile_j * BLOCK).to(tl.int32)]
        if HAS_C:
            acc += beta * c_desc.load(tile).reshape(BLOCK, BLOCK).to(tl.float32)
        result = acc.to(Out.dtype.element_ty)
        o_desc.store(tile, result.reshape(1, BLOCK, BLOCK))
        if tile_i != tile_j:
            mirror = [batch.to(tl.int32), (tile_j * BLOCK).to(tl.int32), (tile_i * BLOCK).to(tl.int32)]
            o_desc.store(mirror, tl.trans(result).reshape(1, BLOCK, BLOCK))
    else:
        inside = (rows[:, None] < M) & (cols[None, :] < M)
        if HAS_C:
            c_ptrs = C + batch * stride_c_batch + rows[:, None] * stride_c_row + cols[None, :] * stride_c_col
            acc += beta * tl.load(c_ptrs, mask=inside, other=0.0).to(tl.float32)
        result = acc.to(Out.dtype.element_ty)
        out_base = Out + batch * stride_o_batch
        tl.store(out_base + rows[:, None] * stride_o_row + cols[None, :] * stride_o_col, result, mask=inside)
        if tile_i != tile_j:
            mirrored = tl.trans(result)
            mirror_ptrs = out_base + cols[:, None] * stride_o_row + rows[None, :] * stride_o_col
            tl.store(mirror_ptrs, mirrored, mask=(cols[:, None] < M) & (rows[None, :] < M))


# TMA descriptors carry their block shape, so every TMA config shares one (128 × 64 won every measured shape).
TMA_BLOCK, TMA_BLOCK_K = 128, 64


def _configs():
    configs = []
    for block, block_k, warps, stages in [
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 64, 8, 5),
        (128, 64, 4, 4),
        (128, 32, 4, 5),
        (128, 128, 8, 3),
        (64, 64, 4, 4),
        (64, 128, 4, 3),
    ]:
        configs.append(triton.Config({"BLOCK": block, "BLOCK_K": block_k, "USE_TMA": False, "PERSISTENT": False},
                                     num_warps=warps, num_stages=stages))
    for persistent, warps, stages in itertools.product((False, True), (8, 4), (3, 4)):
        configs.append(triton.Config({"BLOCK": TMA_BLOCK, "BLOCK_K": TMA_BLOCK_K, "USE_TMA": True,
                                      "PERSISTENT": persistent}, num_warps=warps, num_stages=stages))
    return configs


def _allowed_loads(configs, named_args, **kwargs):
    """Keep the configs whose access style `LOADS` allows ('pointer', 'tma', 'persistent' (TMA) or 'any')."""
    loads = kwargs["LOADS"]
    if loads == "persistent":
        return [c for c in configs if c.kwargs["PERSISTENT"]]
    return [c for c in configs if loads == "any" or c.kwargs["USE_TMA"] == (loads == "tma")]


def _tiles_divide(args) -> bool:
    """M and K are multiples of the tile sizes: the pointer loads may drop their bounds masks."""
    return args["M"] % args["BLOCK"] == 0 and args["K"] % args["BLOCK_K"] == 0


_sym_mm_heuristic = triton.heuristics({"EVEN": _tiles_divide})(_sym_mm_kernel)
# cache_results: the choices are kept in Triton's cache directory, so a restarted job skips benchmarking every
# config per shape (benchmarks/results/first_call.md)
_sym_mm_tuned = triton.autotune(configs=_configs(), key=["M", "K", "HAS_C", "LOADS"], cache_results=True,
                                prune_configs_by={"early_config_prune": _allowed_loads})(_sym_mm_heuristic)
_INTERPRET_CONFIG = {"BLOCK": 16, "BLOCK_K": 16}
_INTERPRET_SMS = 3  # persistent programs under the interpreter: each loops over several tiles



def tma_ready(*tensors: torch.Tensor) -> bool:
    """TMA needs an sm90+ GPU (or the interpreter), a contiguous inner dim, 16-byte aligned bases and strides."""
    if not (INTERPRETING or (tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device)[0] >= 9)):
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def _descriptor(t: torch.Tensor, block: int, block_cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block, block_cols])


def symmetric_matmul(A, B, C=None, alpha: float = 1.0, beta: float = 0.0, tma: bool | None = None,
                     persistent: bool = False) -> torch.Tensor:
    """alpha·A·Bᵀ + beta·C for batched A, B [b, m, k] and C [b, m, m], assuming the result is symmetric.

    `tma`: True / False restrict the kernel's loads and stores to TMA / pointers; None lets the autotuner choose
    between them where `tma_ready` (pointers elsewhere). `persistent=True` restricts them to the persistent TMA
    kernel (tests, benchmarks)."""
    if A.ndim != 3 or B.shape != A.shape:
        raise ValueError(f"symmetric_matmul needs A and B of the same shape [b, m, k], got {A.shape} and {B.shape}")
    batch, m, k = A.shape
    has_c = C is not None and beta != 0.0
    if has_c and C.shape != (batch, m, m):
        raise ValueError(f"C must be [b, m, m] = {(batch, m, m)}, got {tuple(C.shape)}")
    out = torch.empty((batch, m, m), dtype=A.dtype, device=A.device)
    if out.numel() == 0:
        return out
    ready = tma_ready(A, B, out, *([C] if has_c else []))
    if (tma or persistent) and not ready:
        raise ValueError("tma=True needs an sm90+ GPU and A, B, C and the [b, m, m] result with a contiguous inner "
                         "dim and 16-byte aligned strides (m a multiple of 8 for fp16); pass tma=None to fall back "
                         "to pointer loads")
    if persistent and tma is False:
        raise ValueError("persistent=True runs the TMA kernel; drop tma=False")
    loads = "pointer" if tma is False or not ready else ("persistent" if persistent else "tma" if tma else "any")
    block, block_k = (16, 16) if INTERPRETING else (TMA_BLOCK, TMA_BLOCK_K)
    a_desc = b_desc = c_desc = o_desc = None
    if loads != "pointer":
        a_desc = _descriptor(A, block, block_k)
        b_desc = a_desc if B is A else _descriptor(B, block, block_k)
        o_desc = _descriptor(out, block, block)
        c_desc = _descriptor(C, block, block) if has_c else o_desc  # unused when HAS_C is False
    c = C if has_c else out  # an unused pointer when HAS_C is False
    args = (
        A, B, a_desc, b_desc, c, out, c_desc, o_desc, m, k, batch,
        *A.stride(), *B.stride(), *c.stride(), *out.stride(),
        float(alpha), float(beta),
    )  # fmt: skip
    if INTERPRETING:
        meta = {**_INTERPRET_CONFIG, "USE_TMA": loads in ("tma", "persistent"), "PERSISTENT": loads == "persistent"}
        _sym_mm_heuristic[_grid(m, batch, meta, _INTERPRET_SMS)](*args, HAS_C=has_c, LOADS=loads,
                                                                NUM_SMS=_INTERPRET_SMS, **meta)
    else:
        key = (m, k, has_c, loads, A.dtype, c.dtype, out.dtype, A.device.index)
        _launch_tuned(args, key, m, batch, HAS_C=has_c, LOADS=loads, NUM_SMS=sm_count(A.device.index))
    return out


_TUNED: dict[tuple, triton.Config] = {}


def _launch_tuned(args, key, m, batch, **meta):
    """Autotune once per key, then launch the chosen config directly: the autotuner's dispatch costs host time on
    every call, and a Muon step makes hundreds of these calls."""
    config = _TUNED.get(key)
    sms = meta["NUM_SMS"]
    if config is None:
        _sym_mm_tuned[lambda chosen: _grid(m, batch, chosen, sms)](*args, **meta)
        _TUNED[key] = _sym_mm_tuned.best_config
        return
    _sym_mm_heuristic[_grid(m, batch, config.kwargs, sms)](
        *args, **meta, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _grid(m: int, batch: int, meta: dict, sms: int) -> tuple[int, int]:
    """One program per lower tile and batch element, or for persistent configs one per SM (at most one per tile)."""
    tiles = triton.cdiv(m, meta["BLOCK"])
    lower = tiles * (tiles + 1) // 2
    return (min(sms, lower * batch), 1) if meta["PERSISTENT"] else (lower, batch)


# Below this many rows a symmetric tile grid has too few tiles to fill the GPU, so the products go to cuBLAS
# (a launch-size heuristic: the measured shapes all have >= 1024 rows).
MIN_TRITON_ROWS = 256

# The warp-specialized Gluon kernels for Hopper, in order of preference, as (module, its product's name, the least
# rows and inner dimension it is chosen for). Wide 128 × 256 tiles shared by two warpgroups run the main loop
# faster, but their epilogue stops the tensor cores, which 128 × 128 ping-pong tiles hide behind the other
# warpgroup's MMAs: the wide tiles win where a tile's main loop is long against its epilogue. In the Muon step they
# won on the long Grams and lost on the m×m products of 2048 (`optimizer_step_h100_wide.md`), and alone they lost
# on 1536 rows (`symmetric_kernel_wide.md`). Each module has `ready`, `disable` and `FRONTEND_ERRORS`.
WIDE_MIN_ROWS, WIDE_MIN_INNER = 2048, 3072
HOPPER_KERNELS = ((symmetric_wide, "symmetric_matmul_wide", WIDE_MIN_ROWS, WIDE_MIN_INNER),
                  (symmetric_ws, "symmetric_matmul_ws", 0, 0))


class TritonOps:
    """Symmetric products and the input normalization in Triton (half the tiles; one coalesced pass); general
    products stay on cuBLAS (`TorchOps.mm`)."""

    name = "triton"
    mm = staticmethod(TorchOps.mm)

    @staticmethod
    def scaled_copy(X, norm, out) -> torch.Tensor:
        if X.dtype not in scaled_copy_kernel.SUPPORTED_DTYPES:  # fp64 stays on torch, like sym_mm below
            return TorchOps.scaled_copy(X, norm, out)
        return scaled_copy_kernel.scaled_copy(X, norm, out)

    @staticmethod
    def sym_mm(A, B, C=None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
        # fp64 goes to cuBLAS too: the kernel accumulates in fp32, which would quietly end an fp64 iteration.
        if A.dtype == torch.float64 or (A.size(-2) < MIN_TRITON_ROWS and not INTERPRETING):
            return TorchOps.sym_mm(A, B, C, alpha, beta)
        C = C if beta != 0.0 else None
        for kernel, product, min_rows, min_inner in HOPPER_KERNELS if not INTERPRETING else ():
            if A.size(-2) >= min_rows and A.size(-1) >= min_inner and kernel.ready(A, B, C):
                try:
                    return getattr(kernel, product)(A, B, C, alpha, beta)
                except kernel.FRONTEND_ERRORS as error:  # a Gluon API this kernel does not match
                    kernel.disable(error)
        return symmetric_matmul(A, B, C, alpha, beta)
