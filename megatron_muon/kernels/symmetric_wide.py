"""Wide-tile symmetric products for Hopper, in Gluon: out = alpha·A·Bᵀ + beta·C on 128 × 256 tiles, mirrored.

Same contract as `symmetric_ws.symmetric_matmul_ws`. Where that kernel gives each of two consumer warpgroups its own
128 × 128 tile (ping-pong), here both warpgroups share one 128 × 256 tile, 64 rows each, so every MMA is Hopper's
widest (m64n256k16) and the operands of a given number of MMAs take a quarter less shared-memory and L2 traffic.
One producer warp streams the operands through TMA into a ring and keeps loading the next tile while the consumers
run an epilogue; the epilogue stops the tensor cores (the ping-pong kernel hides it), so this kernel pays off where a
tile's main loop is long (`symmetric.HOPPER_KERNELS` says where). The tile and its mirror leave through two epilogue
buffers; with one shared buffer (the mirror waits for the tile's store to leave) a deeper ring fits instead.

Row block i (128 rows) takes the column pairs p with 2p ≤ i (256 columns each). Where 2p = i the pair's second half
lies above the diagonal: it is computed but not stored (its mirror comes from row i + 1), 6% more MMAs than the
lower 128-tiles at m = 2048. Every stored block below the diagonal is also written transposed into its mirror.
"""

from __future__ import annotations

import functools

import torch

from megatron_muon.kernels.gluon_support import (FRONTEND_ERRORS, KernelSwitch, TensorDescriptor,  # noqa: F401
                                                 fence_async_shared, gl, gluon, is_hopper, mbarrier, tma,
                                                 warpgroup_mma, warpgroup_mma_wait)
from megatron_muon.kernels.ops import sm_count

ROWS, COLUMNS = 128, 256
# 3 × 48 KB of operands (64-wide k-slices) + one 64 KB epilogue buffer that the tile and its mirror share: fewer ring
# waits per MMA than 4 × 24 KB with two buffers (32, 4, 2), measured faster on the long Grams and in the step
# (`benchmarks/symmetric_kernel.py --wide 64x3x1 32x4x2`, `optimizer_step_h100_rounds.md`).
TILE_K, STAGES, EPILOGUE_BUFFERS = 64, 3, 1
CONSUMER_WARPS = 8
SWITCH = KernelSwitch("wide-tile Hopper symmetric kernel")


def available() -> bool:
    return SWITCH.available()


def disable(error: Exception) -> None:
    """Turn the kernel off for this process (the next kernel takes over), with one warning that says why."""
    SWITCH.disable(error)


def ready(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor | None) -> bool:
    """Hopper (sm90 exactly: the kernel uses wgmma), fp16/bf16, m a multiple of 128, contiguous operands with
    16-byte aligned rows (TMA), and the same dtype everywhere."""
    if not available() or not A.is_cuda or not is_hopper(A.device.index or 0):
        return False
    if A.dtype not in (torch.float16, torch.bfloat16) or A.size(-2) % ROWS or A.size(-1) == 0:
        return False
    tensors = [A, B] + ([C] if C is not None else [])
    return all(t.dtype == A.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.size(-1) * 2 % 16 == 0
               for t in tensors)


def layout() -> tuple[int, int, int]:
    """(k-slice, ring depth, epilogue buffers) of the launches that follow."""
    return TILE_K, STAGES, EPILOGUE_BUFFERS


def set_layout(tile_k: int, stages: int, buffers: int) -> None:
    """Another layout for the launches that follow (the benchmarks compare layouts); `shared_bytes` says whether
    it fits a block."""
    assert buffers in (1, 2) and tile_k % 16 == 0 and stages >= 2, (tile_k, stages, buffers)
    global TILE_K, STAGES, EPILOGUE_BUFFERS
    TILE_K, STAGES, EPILOGUE_BUFFERS = tile_k, stages, buffers


def shared_bytes(tile_k: int, stages: int, buffers: int) -> int:
    """Shared memory of one block (16-bit operands) but its few barriers: the operand ring and the epilogue."""
    return stages * (ROWS + COLUMNS) * tile_k * 2 + buffers * ROWS * COLUMNS * 2


def tiles_per_matrix(m: int) -> int:
    """Row block i takes i // 2 + 1 column pairs: q(q + 1) tiles for the first 2q row blocks."""
    blocks = m // ROWS
    half = blocks // 2
    return half * (half + 1) + (half + 1) * (blocks % 2)


if gluon is not None:
    BLOCK_M = gl.constexpr(ROWS)
    BLOCK_N = gl.constexpr(COLUMNS)
    HALF = gl.constexpr(COLUMNS // 2)
    WARPS = gl.constexpr(CONSUMER_WARPS)

    @gluon.jit
    def _tile_coordinates(tile, per_matrix):
        """Linear tile index -> (batch element, row block i, column pair p). Rows 2q and 2q + 1 start at tiles
        q(q + 1) and (q + 1)²."""
        t = tile % per_matrix
        q = ((gl.sqrt(4.0 * t.to(gl.float32) + 1.0) - 1.0) * 0.5).to(gl.int32)
        q = gl.where(q * (q + 1) > t, q - 1, q)  # float rounding can land one off
        q = gl.where((q + 1) * (q + 2) <= t, q + 1, q)
        odd = t >= (q + 1) * (q + 1)
        i = 2 * q + odd.to(gl.int32)
        p = gl.where(odd, t - (q + 1) * (q + 1), t - q * (q + 1))
        return tile // per_matrix, i, p

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, total, per_matrix,
                  NUM_STAGES: gl.constexpr):
        """Streams every tile's A (128 rows) and B (256 rows) k-slices, in the consumers' order, into the ring."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        count = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            batch, tile_i, pair = _tile_coordinates(tile, per_matrix)
            for k in range(0, K, BLOCK_K):
                slot = count % NUM_STAGES
                mbarrier.wait(empty_bars.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
                bar = ready_bars.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [batch * M + tile_i * BLOCK_M, k], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(b_desc, [batch * M + pair * BLOCK_N, k], bar, b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready_bars, empty_bars, c_desc, wide_desc, half_desc, tall_desc, o_buf, t_buf,
                  c_bar, M, K, total, per_matrix, alpha, beta, HAS_C: gl.constexpr, NUM_STAGES: gl.constexpr,
                  SHARED_EPILOGUE: gl.constexpr):
        """Both warpgroups: the MMAs of one 128 × 256 tile, then its epilogue (scale, C, the stores). The mirror's
        stores drain while the next tile's MMAs run (with one shared buffer, the tile's store leaves first); C is
        loaded into the tile's buffer halfway through the main loop, once the last stores have left."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        dtype: gl.constexpr = o_buf.dtype
        ksteps = gl.cdiv(K, a_bufs.shape[2])
        c_step = ksteps // 2  # every SM stores at once at the tiles' ends: give the stores time to drain
        count = 0
        c_phase = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            batch, tile_i, pair = _tile_coordinates(tile, per_matrix)
            row, col = batch * M + tile_i * BLOCK_M, pair * BLOCK_N
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            previous = 0
            for kk in range(ksteps):
                slot = count % NUM_STAGES
                mbarrier.wait(ready_bars.index(slot), (count // NUM_STAGES) & 1)
                token = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(token, ))
                if kk > 0:
                    mbarrier.arrive(empty_bars.index(previous), count=1)  # its MMAs have completed
                if HAS_C and kk == c_step:
                    tma.store_wait(0)
                    mbarrier.expect(c_bar, c_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(c_desc, [row, col], c_bar, o_buf)
                previous = slot
                count += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index(previous), count=1)

            result = acc * alpha
            if HAS_C:
                mbarrier.wait(c_bar, c_phase)
                c_phase ^= 1
                result += beta * o_buf.load(acc_layout).to(gl.float32)
            else:
                tma.store_wait(0)  # the previous tile's stores have left both buffers
            out = result.to(dtype)
            o_buf.store(out)  # each thread writes back the elements it read from C (same layout): no barrier
            fence_async_shared()
            if tile_i == 2 * pair:  # the second half lies above the diagonal
                tma.async_copy_shared_to_global(half_desc, [row, col], o_buf.slice(0, HALF, dim=1))
            else:
                tma.async_copy_shared_to_global(wide_desc, [row, col], o_buf)
            if tile_i > 2 * pair:  # mirror the blocks below the diagonal
                if SHARED_EPILOGUE:
                    tma.store_wait(0)  # t_buf is o_buf: the tile's store has read it
                t_buf.permute((1, 0)).store(out)
                fence_async_shared()
                mirror_row, mirror_col = batch * M + pair * BLOCK_N, tile_i * BLOCK_M
                if tile_i == 2 * pair + 1:  # the second block is the diagonal one, stored above
                    tma.async_copy_shared_to_global(half_desc, [mirror_row, mirror_col], t_buf.slice(0, HALF))
                else:
                    tma.async_copy_shared_to_global(tall_desc, [mirror_row, mirror_col], t_buf)
        tma.store_wait(0)

    @gluon.jit
    def _sym_mm_wide_kernel(a_desc, b_desc, c_desc, wide_desc, half_desc, tall_desc, M, K, total, per_matrix,
                            alpha, beta, HAS_C: gl.constexpr, NUM_STAGES: gl.constexpr,
                            EPILOGUE_BUFFERS: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=1)
        o_buf = gl.allocate_shared_memory(dtype, wide_desc.block_type.shape, wide_desc.layout)
        if EPILOGUE_BUFFERS == 2:
            t_buf = gl.allocate_shared_memory(dtype, tall_desc.block_type.shape, tall_desc.layout)
        else:
            t_buf = o_buf._reinterpret(dtype, tall_desc.block_type.shape, tall_desc.layout)
        c_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(c_bar, count=1)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, c_desc, wide_desc, half_desc, tall_desc, o_buf,
                         t_buf, c_bar, M, K, total, per_matrix, alpha, beta, HAS_C, NUM_STAGES,
                         EPILOGUE_BUFFERS == 1)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, total, per_matrix,
                         NUM_STAGES)),
        ], [1], [40])


@functools.cache
def _layout(dtype: torch.dtype, shape: tuple[int, int]):
    return gl.NVMMASharedLayout.get_default_for(list(shape), gl.float16 if dtype == torch.float16 else gl.bfloat16)


def descriptors(A, B, C, out):
    """TMA descriptors over the batch folded into rows: A's and B's k-slices, C's tile, and the three stores."""
    def over(tensor, shape):
        return TensorDescriptor.from_tensor(tensor.view(-1, tensor.size(-1)), list(shape), _layout(A.dtype, shape))

    a_desc = over(A, (ROWS, TILE_K))
    b_desc = over(B, (COLUMNS, TILE_K))
    wide = over(out, (ROWS, COLUMNS))
    c_desc = over(C, (ROWS, COLUMNS)) if C is not None else wide
    return a_desc, b_desc, c_desc, wide, over(out, (ROWS, ROWS)), over(out, (COLUMNS, ROWS))


def symmetric_matmul_wide(A, B, C=None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """alpha·A·Bᵀ + beta·C for [b, m, k] A, B and [b, m, m] C (where `ready`), assuming the result is symmetric."""
    batch, m, k = A.shape
    assert B.shape == A.shape and ready(A, B, C), "call symmetric_wide.ready first"
    has_c = C is not None and beta != 0.0
    out = torch.empty((batch, m, m), dtype=A.dtype, device=A.device)
    if out.numel() == 0:
        return out
    per_matrix = tiles_per_matrix(m)
    total = per_matrix * batch
    grid = (min(sm_count(A.device.index), total), )
    _sym_mm_wide_kernel[grid](*descriptors(A, B, C if has_c else None, out), m, k, total, per_matrix,
                              float(alpha), float(beta), has_c, STAGES, EPILOGUE_BUFFERS, num_warps=CONSUMER_WARPS)
    return out
