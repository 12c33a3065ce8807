"""Warp-specialized symmetric products for Hopper, in Gluon: out = alpha·A·Bᵀ + beta·C, lower tiles, mirrored.

Same contract as `symmetric.symmetric_matmul`, with the work split across warps the way CUTLASS's "ping-pong"
GEMMs do: one producer warp streams A and B tiles into a ring of shared-memory stages through TMA, and two
consumer warpgroups take alternate 128 × 128 tiles. Their main loops take turns (an mbarrier pair passes the turn),
so one consumer's epilogue (scale, C, the tile and its transposed mirror stored through TMA) runs while the other
consumer's MMAs keep the tensor cores busy. The Triton kernel runs epilogues with the tensor cores idle, and its
main loop interleaves load issue with MMAs. On the H200 the Gram stacks of the reference set orthogonalize faster
with this kernel (docs/design/newton_schulz.md).

The batch is folded into rows (2-D descriptors over [b·m, k]), so it needs m to be a multiple of the tile.
`ready(...)` says when it applies; `TritonOps.sym_mm` falls back to the Triton kernel otherwise. Gluon is
Triton's experimental lower-level language, so its API can change between Triton releases: the CPU tests compile
this kernel for sm90, and a Triton without Gluon leaves every call to the Triton kernel.
"""

from __future__ import annotations

import functools

import torch
import triton

from megatron_muon.kernels.gluon_support import (FRONTEND_ERRORS, KernelSwitch, TensorDescriptor,  # noqa: F401
                                                 fence_async_shared, gl, gluon, is_hopper, mbarrier, tma,
                                                 warpgroup_mma, warpgroup_mma_wait)
from megatron_muon.kernels.ops import sm_count

TILE, TILE_K = 128, 64
STAGES = 4  # 4 × 32 KB of operands + two 32 KB epilogue buffers: 197 KB of shared memory
CONSUMER_REGISTERS = 224
SWITCH = KernelSwitch("warp-specialized Hopper symmetric kernel")


def available() -> bool:
    return SWITCH.available()


def disable(error: Exception) -> None:
    """Turn the kernel off for this process (the Triton kernel takes over), with one warning that says why."""
    SWITCH.disable(error)


def ready(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor | None) -> bool:
    """Hopper (sm90 exactly: the kernel uses wgmma), fp16/bf16, m a multiple of the tile, contiguous operands with
    16-byte aligned rows (TMA), and the same dtype everywhere."""
    if not available() or not A.is_cuda or not is_hopper(A.device.index or 0):
        return False
    if A.dtype not in (torch.float16, torch.bfloat16) or A.size(-2) % TILE or A.size(-1) == 0:
        return False
    tensors = [A, B] + ([C] if C is not None else [])
    return all(t.dtype == A.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.size(-1) * 2 % 16 == 0
               for t in tensors)


if gluon is not None:
    BLOCK = gl.constexpr(TILE)
    BLOCK_K = gl.constexpr(TILE_K)

    @gluon.jit
    def _tile_coordinates(tile, per_matrix):
        """Linear tile index over a batch of lower triangles -> (batch element, row tile, col tile)."""
        t = tile % per_matrix
        i = ((gl.sqrt(8.0 * t.to(gl.float32) + 1.0) - 1.0) * 0.5).to(gl.int32)
        i = gl.where(i * (i + 1) // 2 > t, i - 1, i)  # float rounding can land one off
        i = gl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
        return tile // per_matrix, i, t - i * (i + 1) // 2

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, total, per_matrix,
                  NUM_STAGES: gl.constexpr):
        """Streams every tile's A and B k-slices, in the consumers' order, into the ring."""
        count = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            batch, tile_i, tile_j = _tile_coordinates(tile, per_matrix)
            for k in range(0, K, BLOCK_K):
                slot = count % NUM_STAGES
                mbarrier.wait(empty_bars.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
                bar = ready_bars.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [batch * M + tile_i * BLOCK, k], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(b_desc, [batch * M + tile_j * BLOCK, k], bar, b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _consumer(which: gl.constexpr, a_bufs, b_bufs, ready_bars, empty_bars, my_turn, other_turn, c_desc, o_desc,
                  o_buf, c_bar, M, K, total, per_matrix, alpha, beta, HAS_C: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
        """Tiles `which`, `which` + 2, ... of this program. A consumer waits for its turn before its main loop, so
        it is never more than one ring phase ahead of the barriers it waits on."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK, 16])
        nprog = gl.num_programs(0)
        ksteps = gl.cdiv(K, BLOCK_K)
        local = which
        turn = which  # turn n waits for the other consumer's n-th hand-over
        c_phase = 0
        for tile in range(gl.program_id(0) + which * nprog, total, 2 * nprog):
            batch, tile_i, tile_j = _tile_coordinates(tile, per_matrix)
            if turn > 0:
                mbarrier.wait(my_turn, (turn - 1) & 1)
            turn += 1
            count = local * ksteps
            local += 2
            slot = count % NUM_STAGES
            mbarrier.wait(ready_bars.index(slot), (count // NUM_STAGES) & 1)
            acc = gl.zeros([BLOCK, BLOCK], gl.float32, acc_layout)
            token = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(token, ))
            for _ in range(1, ksteps):
                previous = slot
                count += 1
                slot = count % NUM_STAGES
                mbarrier.wait(ready_bars.index(slot), (count // NUM_STAGES) & 1)
                token = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(token, ))
                mbarrier.arrive(empty_bars.index(previous), count=1)  # its MMA has completed
            mbarrier.arrive(other_turn, count=1)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index(slot), count=1)

            row, col = batch * M + tile_i * BLOCK, tile_j * BLOCK
            result = acc * alpha
            if HAS_C:
                tma.store_wait(0)
                mbarrier.expect(c_bar, c_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(c_desc, [row, col], c_bar, o_buf)
                mbarrier.wait(c_bar, c_phase)
                c_phase ^= 1
                # the store below writes each thread's own elements back (same layout): no barrier needed
                result += beta * o_buf.load(acc_layout).to(gl.float32)
            out = result.to(o_desc.dtype)
            tma.store_wait(0)
            o_buf.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [row, col], o_buf)
            if tile_i != tile_j:
                tma.store_wait(0)
                o_buf.permute((1, 0)).store(out)
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [batch * M + tile_j * BLOCK, tile_i * BLOCK], o_buf)
        tma.store_wait(0)

    @gluon.jit
    def _sym_mm_ws_kernel(a_desc, b_desc, c_desc, o_desc, M, K, total, per_matrix, alpha, beta,
                          HAS_C: gl.constexpr, NUM_STAGES: gl.constexpr, REGISTERS: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=1)
        o_bufs = gl.allocate_shared_memory(dtype, [2] + o_desc.block_type.shape, o_desc.layout)
        c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(c_bars.index(i), count=1)
            mbarrier.init(turns.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (0, a_bufs, b_bufs, ready_bars, empty_bars, turns.index(0), turns.index(1), c_desc, o_desc,
                         o_bufs.index(0), c_bars.index(0), M, K, total, per_matrix, alpha, beta, HAS_C, NUM_STAGES)),
            (_consumer, (1, a_bufs, b_bufs, ready_bars, empty_bars, turns.index(1), turns.index(0), c_desc, o_desc,
                         o_bufs.index(1), c_bars.index(1), M, K, total, per_matrix, alpha, beta, HAS_C, NUM_STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, K, total, per_matrix,
                         NUM_STAGES)),
        ], [4, 1], [REGISTERS, 40])


@functools.cache
def _layouts(dtype: torch.dtype):
    element = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return (gl.NVMMASharedLayout.get_default_for([TILE, TILE_K], element),
            gl.NVMMASharedLayout.get_default_for([TILE, TILE], element))


def symmetric_matmul_ws(A, B, C=None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """alpha·A·Bᵀ + beta·C for [b, m, k] A, B and [b, m, m] C (where `ready`), assuming the result is symmetric."""
    batch, m, k = A.shape
    assert B.shape == A.shape and ready(A, B, C), "call symmetric_ws.ready first"
    has_c = C is not None and beta != 0.0
    out = torch.empty((batch, m, m), dtype=A.dtype, device=A.device)
    if out.numel() == 0:
        return out
    operand, tile = _layouts(A.dtype)
    a_desc = TensorDescriptor.from_tensor(A.view(batch * m, k), [TILE, TILE_K], operand)
    b_desc = a_desc if B is A else TensorDescriptor.from_tensor(B.view(batch * m, k), [TILE, TILE_K], operand)
    o_desc = TensorDescriptor.from_tensor(out.view(batch * m, m), [TILE, TILE], tile)
    c_desc = TensorDescriptor.from_tensor(C.view(batch * m, m), [TILE, TILE], tile) if has_c else o_desc
    tiles = m // TILE
    per_matrix = tiles * (tiles + 1) // 2
    total = per_matrix * batch
    grid = (min(sm_count(A.device.index), triton.cdiv(total, 2)), )  # two consumers per program
    _sym_mm_ws_kernel[grid](a_desc, b_desc, c_desc, o_desc, m, k, total, per_matrix, float(alpha), float(beta),
                            has_c, STAGES, CONSUMER_REGISTERS, num_warps=4)
    return out
