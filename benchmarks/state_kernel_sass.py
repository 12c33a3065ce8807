"""Instruction mix of one chunk iteration of the GDN chunk-state kernels (ours and FLA's forward), compiled for sm90
on any machine (no GPU needed): Triton's own ptxas and nvdisasm, pointers and lengths specialized as at run time.

The recurrences are latency-bound (benchmarks/results/fla_state_kernels_tma.md), so what one chunk iteration
waits on (block barriers, TMA waits, shared-memory round trips) matters more than its tensor work.

    python benchmarks/state_kernel_sass.py          # FLA's row needs flash-linear-attention importable
    python benchmarks/state_kernel_sass.py --fused  # registers, spills, shared memory of the fused kernels' tiles
    python benchmarks/state_kernel_sass.py --gluon-maxnreg 168  # the Gluon kernels under a register cap
    python benchmarks/state_kernel_sass.py --chunk-parallel  # every tile of the one-kernel chunk-parallel kernels
    python benchmarks/state_kernel_sass.py --transposes  # transposes of tensor-core results (FLA issue #640's pattern)
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

OPS = ("BAR", "SYNCS", "HMMA", "HGMMA", "LDSM", "STSM", "LDS", "STS", "STG")
KEY_TILE = "tensordesc<bf16[1,64,64]>"  # the 64-column key slices our kernels stream


def compile_sm90(fn, signature: dict, constants: dict, warps: int, stages: int | None = None):
    """The kernel compiled for sm90 by Triton's own ptxas, pointers and lengths specialized as at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name].startswith("*") or name in ("T", "NT")}
    options = {"num_warps": warps} | ({"num_stages": stages} if stages else {})
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _run_on_cubin(tool: str, kernel, *flags: str) -> str:
    import triton

    binary = Path(triton.__file__).parent / "backends/nvidia/bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        cubin.write(kernel.asm["cubin"])
    try:
        return subprocess.run([str(binary), *flags, cubin.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(cubin.name)


def disassemble(fn, signature: dict, constants: dict, warps: int, stages: int | None = None) -> str:
    return _run_on_cubin("nvdisasm", compile_sm90(fn, signature, constants, warps, stages), "-c")


def resources(kernel) -> dict:
    """Registers per thread, stack bytes per thread (spilled registers) and shared memory bytes of a compiled
    kernel."""
    usage = _run_on_cubin("cuobjdump", kernel, "--dump-resource-usage")
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    assert found, usage
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), "shared": kernel.metadata.shared}


def longest_loop(sass: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the longest backward-branching loop: the chunk loop."""
    lines = sass.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:$", line.strip())}
    best = (0, collections.Counter())
    for i, line in enumerate(lines):
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            body = lines[labels[target.group(1)]:i + 1]
            opcodes = [m.group(1) for m in (re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", b) for b in body)
                       if m]
            best = max(best, (len(opcodes), collections.Counter(opcodes)), key=lambda pair: pair[0])
    return best


def ours_forward(block_v: int, warps: int, stages: int) -> str:
    return _run_on_cubin("nvdisasm", forward_kernel("hybrid-1.5b", block_v, warps, stages, True, False), "-c")


def ours_backward(block_v: int, warps: int, stages: int) -> str:
    return _run_on_cubin("nvdisasm", backward_kernel("hybrid-1.5b", block_v, warps, stages, local_dv=False), "-c")


def backward_kernel(shape: str, block_v: int, warps: int, stages: int, local_dv: bool):
    """Our state-gradient kernel compiled for sm90 at one of FUSED_SHAPES; `local_dv` fuses FLA's
    `chunk_bwd_dv_local` into it (the "fused" output terms)."""
    from megatron_muon.ops import state_tma

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    value_tile = f"tensordesc<bf16[1,64,{block_v}]>"
    signature = {"q_desc": KEY_TILE, "k_desc": KEY_TILE, "w_desc": KEY_TILE, "do_desc": value_tile,
                 "dv_desc": value_tile, "g": "*fp32", "dht": "*fp32", "dh": "*bf16", "dv2": "*bf16", "dh0": "*fp32",
                 "skip": "*i32", "scale": "fp32", "T": "i32", "NT": "i32"}
    constants = dict(H=heads, GROUP=group, K=key_dim, V=value_dim, BT=64, BV=block_v, STAGES=stages,
                     USE_FINAL_STATE_GRADIENT=False, USE_INITIAL_STATE=False, LOCAL_DV=local_dv, SKIP=False)
    return compile_sm90(state_tma._chunk_state_bwd_kernel, signature | dict.fromkeys(constants, "constexpr"),
                        constants, warps)


def flas_forward(block_v: int, warps: int, stages: int) -> str:
    import fla.ops.common.chunk_delta_h as chunk_delta_h
    from triton.runtime.autotuner import Autotuner, Heuristics

    kernel = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    signature = {"k": "*bf16", "v": "*bf16", "w": "*bf16", "v_new": "*bf16", "g": "*fp32", "gk": "constexpr",
                 "h": "*bf16", "h0": "constexpr", "ht": "constexpr", "cu_seqlens": "constexpr",
                 "chunk_offsets": "constexpr", "T": "i32"}
    constants = dict(gk=None, h0=None, ht=None, cu_seqlens=None, chunk_offsets=None, H=6, HV=6, K=256, V=512, BT=64,
                     BV=block_v, USE_G=True, USE_GK=False, USE_INITIAL_STATE=False, STORE_FINAL_STATE=False,
                     SAVE_NEW_VALUE=True, STATE_V_FIRST=True, IS_VARLEN=False)
    signature |= {name: "constexpr" for name in constants if name not in signature}
    return disassemble(kernel, signature, constants, warps, stages)


# (key dim, value dim, value heads, value heads per key head) of the two reference GDN shapes
FUSED_SHAPES = {"qwen3-next": (128, 128, 32, 2), "hybrid-1.5b": (256, 512, 6, 1)}


def forward_kernel(shape: str, block_v: int, warps: int, stages: int, store_states: bool, with_output: bool):
    """Our forward state kernel (`state_tma`), with the output inside when `with_output` (the fused forward,
    `ops/chunk_fwd_fused.py`), compiled for sm90 at one of FUSED_SHAPES."""
    from megatron_muon.ops import state_tma

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    signature = {"q_desc": KEY_TILE, "k_desc": KEY_TILE, "w_desc": KEY_TILE,
                 "u_desc": f"tensordesc<bf16[1,64,{block_v}]>", "g": "*fp32", "h0": "*fp32", "h": "*bf16",
                 "v_new": "*bf16", "o": "*bf16", "ht": "*fp32", "skip": "*i32", "scale": "fp32", "T": "i32",
                 "NT": "i32"}
    constants = dict(H=heads, GROUP=group, K=key_dim, V=value_dim, BT=64, BV=block_v, STAGES=stages,
                     USE_INITIAL_STATE=False, STORE_FINAL_STATE=False, STORE_STATES=store_states,
                     WITH_OUTPUT=with_output, SKIP=False)
    return compile_sm90(state_tma._chunk_state_fwd_kernel, signature | dict.fromkeys(constants, "constexpr"),
                        constants, warps)


def fused_forward(shape: str, block_v: int, warps: int, stages: int, store_states: bool = False):
    """Our fused chunk forward (`ops/chunk_fwd_fused.py`) compiled for sm90 at one of FUSED_SHAPES."""
    return forward_kernel(shape, block_v, warps, stages, store_states, True)


def _compile_gluon_sm90(kernel, shape: str, tensors: dict, constants: dict, maxnreg: int | None = None,
                        block_v: int | None = None):
    """A Gluon kernel compiled for sm90 at one of FUSED_SHAPES; `tensors` maps parameter names to "key", "state"
    or "value" (TMA descriptors of our kernels' tiles) or to a pointer type."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from megatron_muon.ops import state_ws

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    block_v = block_v or state_ws.BLOCK_V
    key, state, value = state_ws._layouts(torch.bfloat16, block_v)
    rows = torch.empty(256, heads * max(key_dim, value_dim), dtype=torch.bfloat16)
    descriptors = {
        "key": mangle_type(TensorDescriptor.from_tensor(rows[:, : heads * key_dim], [64, 64], key)),
        "state": mangle_type(TensorDescriptor.from_tensor(rows[:, :key_dim], [block_v, 64], state)),
        "value": mangle_type(TensorDescriptor.from_tensor(rows, [64, block_v], value)),
    }
    constants = {"H": heads, "GROUP": group, "K": key_dim, "V": value_dim, "BV": block_v, **constants}
    signature = {**{name: descriptors.get(kind, kind) for name, kind in tensors.items()}, "T": "i32", "NT": "i32",
                 **{name: "constexpr" for name in constants}}
    return triton.compile(GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4} | ({"maxnreg": maxnreg} if maxnreg else {}))


def forward_gluon(shape: str, store_states: bool, with_output: bool, maxnreg: int | None = None,
                  block_v: int | None = None):
    """The warp-specialized Gluon forward state kernel (`ops/state_ws.py`), with the output inside when
    `with_output` (`ops/chunk_fwd_fused_ws.py`, key dims up to 128), compiled for sm90 at one of FUSED_SHAPES."""
    from megatron_muon.ops import state_ws

    tensors = {"q_desc": "key", "k_desc": "key", "w_desc": "key", "u_desc": "value", "h_desc": "state",
               "v_desc": "value", "o_desc": "value", "g": "*fp32", "h0": "*fp32", "ht": "*fp32", "scale": "fp32"}
    return _compile_gluon_sm90(state_ws._chunk_state_fwd_ws_kernel, shape, tensors,
                               {"USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True, "STORE_STATES": store_states,
                                "WITH_OUTPUT": with_output}, maxnreg, block_v)


def fused_forward_gluon(shape: str, store_states: bool = False):
    """The warp-specialized Gluon fused forward (`ops/chunk_fwd_fused_ws.py`) compiled for sm90 at one of
    FUSED_SHAPES (key dims up to 128)."""
    return forward_gluon(shape, store_states, True)


def backward_gluon(shape: str, local_dv: bool, maxnreg: int | None = None, block_v: int | None = None):
    """The warp-specialized Gluon state-gradient kernel (`ops/state_ws.py`) compiled for sm90 at one of
    FUSED_SHAPES, with or without the chunks' own value gradient inside."""
    from megatron_muon.ops import state_ws

    tensors = {"q_desc": "key", "k_desc": "key", "w_desc": "key", "dh_desc": "state", "dv2_desc": "value",
               "do": "*bf16", "dv": "*bf16", "g": "*fp32", "dht": "*fp32", "dh0": "*fp32", "scale": "fp32"}
    return _compile_gluon_sm90(state_ws._chunk_state_bwd_ws_kernel, shape, tensors,
                               {"USE_FINAL_STATE_GRADIENT": True, "USE_INITIAL_STATE": True, "LOCAL_DV": local_dv},
                               maxnreg, block_v)


def fused_resources_table() -> None:
    """Registers, spills and shared memory of every tile of the fused forward, and of the state-gradient kernel with
    the local value gradient fused in, at both shapes."""
    from megatron_muon.ops.chunk_fwd_fused import FUSED_CONFIGS
    from megatron_muon.ops.state_tma import BACKWARD_CONFIGS

    print("| kernel | shape | BV / warps / stages | registers | stack bytes (spills) | shared KiB |")
    print("|---|---|---|---:|---:|---:|")
    for shape in FUSED_SHAPES:
        kernels = [(f"fused forward{', states kept' if store else ''}", config,
                    lambda c=config, s=store: fused_forward(shape, *c, s))
                   for config in FUSED_CONFIGS for store in (False, True)]
        kernels += [(f"state gradient{', local dv' if local else ''}", config,
                     lambda c=config, d=local: backward_kernel(shape, *c, d))
                    for config in BACKWARD_CONFIGS for local in (False, True)]
        # the Gluon kernels: 32-column value blocks, one consumer warpgroup, a two-stage ring
        if FUSED_SHAPES[shape][0] <= 128:
            kernels += [(f"fused forward, Gluon{', states kept' if store else ''}", (32, 4, 2),
                         lambda s=store: fused_forward_gluon(shape, s)) for store in (False, True)]
        kernels += [(f"state gradient, Gluon{', local dv' if local else ''}", (32, 4, 2),
                     lambda d=local: backward_gluon(shape, d)) for local in (False, True)]
        for name, (block_v, warps, stages), build in kernels:
            used = resources(build())
            print(f"| {name} | {shape} | {block_v}/{warps}/{stages} | {used['registers']} | {used['stack']} | "
                  f"{used['shared'] / 1024:.1f} |")


def fused_backward(shape: str, block_k: int, block_v: int, warps: int, stages: int):
    """The one-kernel chunk-parallel backward (`ops/chunk_bwd_fused.py`) compiled for sm90 at one of FUSED_SHAPES."""
    from megatron_muon.ops import chunk_bwd_fused

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    names = ("q", "k", "v", "v_new", "beta", "g", "A", "h", "do", "dh", "du", "dq", "dk", "dv", "dbeta", "dg",
             "dA_scratch")
    signature = dict.fromkeys(names, "*bf16") | dict.fromkeys(("beta", "g", "dbeta", "dg"), "*fp32")
    signature |= {"scale": "fp32", "T": "i32", "NT": "i32"}
    constants = dict(H=heads // group, HV=heads, K=key_dim, V=value_dim, BT=64, BK=block_k, BV=block_v,
                     STAGES=stages)
    return compile_sm90(chunk_bwd_fused._chunk_bwd_fused_kernel, signature | dict.fromkeys(constants, "constexpr"),
                        constants, warps)


def onepass_backward(shape: str, warps: int, final_state: bool = True):
    """The one-pass chunk backward (`ops/chunk_bwd_onepass.py`, K and V up to 128) compiled for sm90 at one of
    FUSED_SHAPES."""
    from megatron_muon.ops import chunk_bwd_onepass

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    names = ("q", "k", "v", "v_new", "w", "beta", "g", "A", "h", "do", "dht", "dq", "dk", "dv", "dbeta", "dg", "dh0",
             "scratch")
    signature = dict.fromkeys(names, "*bf16") | dict.fromkeys(("beta", "g", "dbeta", "dg", "dht", "dh0"), "*fp32")
    signature |= {"scale": "fp32", "T": "i32", "NT": "i32"}
    constants = dict(H=heads // group, HV=heads, K=key_dim, V=value_dim, BT=64, USE_DHT=final_state,
                     STORE_DH0=final_state)
    return compile_sm90(chunk_bwd_onepass._chunk_bwd_onepass_kernel,
                        signature | dict.fromkeys(constants, "constexpr"), constants, warps)


def fused_intra(shape: str, block_k: int, block_v: int, warps: int):
    """The one-kernel chunk-parallel forward (`ops/chunk_fwd_intra.py`) compiled for sm90 at one of FUSED_SHAPES."""
    from megatron_muon.ops import chunk_fwd_intra

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    signature = dict.fromkeys(("k", "v", "A", "w", "u"), "*bf16")
    signature |= dict.fromkeys(("g", "beta", "g_cumsum"), "*fp32") | {"T": "i32", "scale_log2": "fp32"}
    signature = {name: signature[name] for name in ("k", "v", "g", "beta", "g_cumsum", "A", "w", "u", "T",
                                                    "scale_log2")}
    constants = dict(H=heads // group, HV=heads, K=key_dim, V=value_dim, BT=64, BC=chunk_fwd_intra.BLOCK,
                     BK=block_k, BV=block_v)
    return compile_sm90(chunk_fwd_intra._chunk_fwd_intra_kernel, signature | dict.fromkeys(constants, "constexpr"),
                        constants, warps)


def intra_recompute(shape: str, block_k: int, block_v: int, warps: int):
    """Its w and u step alone (`chunk_fwd_intra._recompute_w_u_kernel`, the backward of a forward that did not keep
    its chunk states) compiled for sm90 at one of FUSED_SHAPES."""
    from megatron_muon.ops import chunk_fwd_intra

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    signature = {"k": "*bf16", "v": "*bf16", "beta": "*fp32", "g_cumsum": "*fp32", "A": "*bf16", "w": "*bf16",
                 "u": "*bf16", "T": "i32"}
    constants = dict(H=heads // group, HV=heads, K=key_dim, V=value_dim, BT=64, BK=block_k, BV=block_v)
    return compile_sm90(chunk_fwd_intra._recompute_w_u_kernel, signature | dict.fromkeys(constants, "constexpr"),
                        constants, warps)


def fused_backward_table() -> None:
    """Registers, spills and shared memory of every tile of the one-kernel chunk-parallel backward and forward at both
    shapes."""
    from megatron_muon.ops.chunk_bwd_fused import CONFIGS
    from megatron_muon.ops.chunk_bwd_onepass import WARPS as ONEPASS_WARPS
    from megatron_muon.ops.chunk_fwd_intra import CONFIGS as INTRA

    print("| kernel | shape | BK / BV / warps (/ stages) | registers | stack bytes (spills) | shared KiB |")
    print("|---|---|---|---:|---:|---:|")
    for shape in FUSED_SHAPES:
        kernels = [("backward", config, lambda c=config: fused_backward(shape, *c)) for config in CONFIGS]
        kernels += [("forward, chunk-parallel part", config, lambda c=config: fused_intra(shape, *c))
                    for config in INTRA]
        if FUSED_SHAPES[shape][0] <= 128:  # a program holds a head's whole state gradient
            kernels += [("one-pass backward", (warps,), lambda n=warps: onepass_backward(shape, n))
                        for warps in ONEPASS_WARPS]
        for name, config, build in kernels:
            used = resources(build())
            print(f"| {name} | {shape} | {'/'.join(map(str, config))} | {used['registers']} | {used['stack']} | "
                  f"{used['shared'] / 1024:.1f} |")


def transposed_products(kernel) -> list[str]:
    """The compiled kernel's transposes of a tensor-core result (`tt.trans` of an `#mma` layout): the pattern Triton
    3.4 to 3.7.0 miscompile on Hopper (FLA issue #640)."""
    return [line.strip() for line in kernel.asm["ttgir"].splitlines()
            if "tt.trans" in line and "#mma" in line.rsplit(":", 1)[-1].split("->")[0]]


def dqkwg_kernel(shape: str, block_k: int, block_v: int, warps: int, stages: int):
    """Our chunk output-gradient kernel (`ops/dqkwg.py`) compiled for sm90 at one of FUSED_SHAPES."""
    from megatron_muon.ops import dqkwg

    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    names = ("q", "k", "v", "w_grad", "g", "h", "do", "dh", "dv", "dq", "dk", "dg")
    signature = dict.fromkeys(names, "*bf16") | dict.fromkeys(("g", "dg"), "*fp32")
    signature |= {"scale": "fp32", "T": "i32", "NT": "i32"}
    constants = dict(H=heads // group, HV=heads, K=key_dim, V=value_dim, BT=64, BK=block_k, BV=block_v,
                     STAGES=stages)
    return compile_sm90(dqkwg._chunk_dqkwg_kernel, signature | dict.fromkeys(constants, "constexpr"), constants,
                        warps)


def flas_wy_backward(shape: str, warps: int):
    """FLA's gated WY backward (`prepare_wy_repr_bwd_kernel`) compiled for sm90 at one of FUSED_SHAPES."""
    from fla.ops.gated_delta_rule import wy_fast
    from triton.runtime.autotuner import Autotuner, Heuristics

    kernel = wy_fast.prepare_wy_repr_bwd_kernel
    while isinstance(kernel, (Autotuner, Heuristics)):  # the JIT function under FLA's wrappers
        kernel = kernel.fn
    key_dim, value_dim, heads, group = FUSED_SHAPES[shape]
    names = ("k", "v", "beta", "g", "A", "dw", "du", "dk", "dv", "db", "dg", "cu_seqlens", "chunk_indices")
    signature = dict.fromkeys(names, "*bf16") | dict.fromkeys(("beta", "g", "db", "dg"), "*fp32")
    signature |= {"cu_seqlens": "*i32", "chunk_indices": "*i32", "T": "i32"}
    constants = dict(H=heads // group, HV=heads, K=key_dim, V=value_dim, BT=64, BK=64, BV=64, USE_G=True,
                     IS_VARLEN=False)
    return compile_sm90(kernel, signature | dict.fromkeys(constants, "constexpr"), constants, warps, 2)


def transposes_table() -> None:
    """How many tensor-core results each backward kernel transposes, compiled for sm90 at both shapes."""
    from megatron_muon.ops.chunk_bwd_fused import CONFIGS
    from megatron_muon.ops.chunk_fwd_intra import CONFIGS as INTRA
    from megatron_muon.ops.dqkwg import CONFIGS as DQKWG

    print("| kernel | shape | warps | wgmma products | transposed tensor-core results |")
    print("|---|---|---:|---:|---:|")
    for shape in FUSED_SHAPES:
        kernels = [("one-kernel backward (ours)", config[2], lambda c=config: fused_backward(shape, *c))
                   for config in CONFIGS[:1]]
        kernels += [("one-kernel forward part (ours)", config[2], lambda c=config: fused_intra(shape, *c))
                    for config in INTRA[:1]]
        kernels += [("dqkwg (ours)", config[2], lambda c=config: dqkwg_kernel(shape, *c)) for config in DQKWG[:1]]
        kernels += [("FLA's gated WY backward", warps, lambda w=warps: flas_wy_backward(shape, w)) for warps in (2, 4)]
        for name, warps, build in kernels:
            try:
                kernel = build()
            except ImportError as error:
                print(f"| {name} | {shape} | {warps} | left out: {error} | |")
                continue
            wgmma = kernel.asm["ttgir"].count("warp_group_dot")
            print(f"| {name} | {shape} | {warps} | {wgmma} | {len(transposed_products(kernel))} |")


def gluon_register_cap_table(maxnreg: int) -> None:
    """Registers, stack bytes and shared memory of every Gluon state kernel at both shapes under a `maxnreg` cap:
    whether two blocks could share an SM (registers and shared memory both halve)."""
    print(f"| kernel (maxnreg {maxnreg}) | shape | registers | stack bytes | shared KiB |")
    print("|---|---|---:|---:|---:|")
    for shape in FUSED_SHAPES:
        kernels = {"forward, states kept": lambda: forward_gluon(shape, True, False, maxnreg),
                   "state gradient": lambda: backward_gluon(shape, False, maxnreg),
                   "state gradient, local dv": lambda: backward_gluon(shape, True, maxnreg)}
        if FUSED_SHAPES[shape][0] <= 128:  # the Gluon fused forward's rings do not fit at K = 256
            kernels["fused forward"] = lambda: forward_gluon(shape, False, True, maxnreg)
        for name, build in kernels.items():
            used = resources(build())
            print(f"| {name} | {shape} | {used['registers']} | {used['stack']} | {used['shared'] / 1024:.1f} |")


def gluon_value_block_table() -> None:
    """Registers, stack bytes and shared memory of the Gluon state kernels per value block (`state_ws.chunk_forward`
    / `chunk_dhu`'s `block_v`) at both shapes: what a wider or narrower block costs an SM."""
    from megatron_muon.ops import state_ws

    print("| kernel | shape | value block | blocks (grid) | registers | stack bytes | shared KiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape, (key_dim, value_dim, heads, _) in FUSED_SHAPES.items():
        for block_v in state_ws.BLOCK_V_CHOICES:
            if value_dim % block_v:
                continue
            kernels = {"forward, states kept": lambda: forward_gluon(shape, True, False, block_v=block_v),
                       "state gradient, local dv": lambda: backward_gluon(shape, True, block_v=block_v)}
            for name, build in kernels.items():
                try:
                    used = resources(build())
                except Exception as error:  # out of shared memory at this shape: say so in the table
                    print(f"| {name} | {shape} | {block_v} | | does not compile: {type(error).__name__} | | |")
                    continue
                print(f"| {name} | {shape} | {block_v} | {heads * value_dim // block_v} | {used['registers']} | "
                      f"{used['stack']} | {used['shared'] / 1024:.1f} |")


def row(label: str, sass: str) -> str:
    count, opcodes = longest_loop(sass)
    return f"| {label} | {count} | " + " | ".join(str(opcodes[op]) for op in OPS) + " |"


def main() -> None:
    if "--fused" in sys.argv[1:]:
        fused_resources_table()
        return
    if "--transposes" in sys.argv[1:]:
        transposes_table()
        return
    if "--chunk-parallel" in sys.argv[1:]:
        fused_backward_table()
        return
    if "--gluon-value-blocks" in sys.argv[1:]:
        gluon_value_block_table()
        return
    if "--gluon-maxnreg" in sys.argv[1:]:
        gluon_register_cap_table(int(sys.argv[sys.argv.index("--gluon-maxnreg") + 1]))
        return
    print("| kernel (BV / warps / stages) | instructions | " + " | ".join(OPS) + " |")
    print("|---|---:|" + "---:|" * len(OPS))
    print(row("ours forward 32/4/3", ours_forward(32, 4, 3)))
    print(row("ours backward 32/8/2", ours_backward(32, 8, 2)))
    try:
        print(row("FLA forward 32/4/3", flas_forward(32, 4, 3)))
    except ImportError as error:
        print(f"FLA's forward left out: {error}")


if __name__ == "__main__":
    main()
