"""How many pieces to cut a tensor into so that Inductor writes each piece's gradient straight into its slice.

Inductor (torch 2.11, `lowering.cat`) lowers a cat of at most 8 pointwise inputs as ONE kernel that evaluates every
input's expression for every element; with more inputs it uses a ConcatKernel that computes each input into its
slice of the output. The gradient of a `torch.split` is such a cat, and so is a forward that stacks per-piece
results. Layers therefore split wide pointwise work into at least MIN_GRADIENT_PIECES pieces (same values).
On the H200 at 16k tokens this replaced the GDN layer's in_proj-gradient and conv-gradient kernels with per-piece
ones and shortened the layer's fwd+bwd kernel time (docs/design/gdn_kernels.md).
"""

from __future__ import annotations

MIN_GRADIENT_PIECES = 9


def piece_sizes(width: int, wanted: int, max_pieces: int = 64) -> list[int]:
    """`width` cut into the fewest equal pieces, at least `wanted` of them; one piece when no such cut has at most
    `max_pieces` pieces (a width with no small divisor: splitting it finer would only slow the compile down)."""
    counts = (n for n in range(max(wanted, 1), min(width, max_pieces) + 1) if width > 0 and width % n == 0)
    count = next(counts, 1)
    return [width // count] * count


def split_sizes(width: int, wanted: int) -> list[int]:
    """At least `wanted` pieces of `width` that need not be equal: equal ones when `width` has a divisor between
    `wanted` and 2 * `wanted`, else `wanted` pieces of width // wanted plus the remainder (a width with no small
    divisor, e.g. a prime, gets no equal cut). A width below `wanted` is cut into pieces of one element."""
    if width < wanted:
        return [1] * width if width > 0 else [width]
    equal = piece_sizes(width, wanted, max_pieces=2 * wanted)
    if len(equal) >= wanted:
        return equal
    step = width // wanted
    return [step] * wanted + ([width - step * wanted] if width > step * wanted else [])
