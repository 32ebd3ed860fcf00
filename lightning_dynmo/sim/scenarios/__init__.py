"""Per-layer cost trajectories of the six dynamism cases at the DynMo paper's scale, and static vs
dynamic balancing of them in the simulator.

**What is measured and what is modelled.** Every layer cost starts from a *measured* profile of
the paper's GPT (appendix A: hidden 1024, 32 heads, sequence 2048, micro-batch 2; GPT-2
vocabulary padded to 50304): :class:`Profile` holds the forward/backward milliseconds of one
transformer block at token fractions 1/16 ... 1 (packed tokens), of its causal attention alone,
of its MLP at token counts (one MoE expert), of the embedding, the final norm and the LM head
with its fp32 cross-entropy. The bundled profile (``profiles/h100_gpt_h1024_s2048_mb2.json``)
was measured by ``benchmarks/block_profile.py`` on one NVIDIA H100 80GB (bf16, torch 2.11, CUDA
graphs, so kernel time without Python launch overhead). :meth:`Profile.from_flops` is the
FLOP-count fallback (no measurement). How each dynamism *changes* those costs over training is a
**model** with the parameters below; none is fitted to the paper's speedups or bubbles.

The model is the whole GPT: ``[embedding] + blocks + [final norm] + [head + loss]``, as this
package's :class:`~lightning_dynmo.models.GPT` lays it out (the head with its loss costs about
four blocks, which is why even a dense model is not balanced by equal layer counts).

Parameters and where they come from (P: the DynMo paper, ``seeds/001``; M: measured here; L:
other literature; A: our assumption, exposed as an argument):

=================  ==========================================================================
case               parameters
=================  ==========================================================================
all                block/attention/MLP/head costs (M, H100 profile); 16 bytes of state per
                   parameter (L: bf16 weight + grad, fp32 master + two Adam moments);
                   activation stored for backward ~34 s b h bytes per block (L: Korthikanti et
                   al. 2022 with flash attention); 10,000 iterations (P, appendix A)
freezing           frozen prefix grows front to back (P, F.4: Egeria) to ``final_frozen`` =
                   0.75 of the blocks (A); frozen layers run forward only, the first trainable
                   block computes weight gradients only (M), frozen layers skip the
                   data-parallel all-reduce
early_exit         exit points after 1/4, 1/2, 3/4 of the blocks (A); the share of tokens that
                   leave at each grows linearly to ``final_exit_rate`` = 0.5 (A); a block costs
                   its measured cost at its token fraction (packed tokens: attention ~ T^2, small
                   GEMMs less efficient) (M); every token still reaches the head
pruning            Zhu-Gupta cubic schedule to 90 % from iteration 3000, every 1000, 4 steps:
                   52 / 79 / 89 / 90 % (P, 4.1); global magnitude threshold over blocks whose
                   weight scales are log-normal, ``spread`` = 0.35 (A); sparse kernels cost
                   ``density / 0.25`` of dense below 25 % density (P, Fig. 6: Sputnik beats
                   cuBLAS from 75 % sparsity on H100); attention scores, embedding and head stay
                   dense (A); param balancers see non-zero counts
moe                Mixtral-style (P, F.2): every block MoE, 8 experts, top-2, dropless; expert
                   parallelism over 8 data-parallel ranks (P: 8-way data x 16-way pipeline), so
                   a layer runs at the pace of its busiest expert rank (max over EP ranks of the
                   measured MLP time at its token count); routing shares are a softmax of AR(1)
                   logits whose spread reaches the paper's "up to 40 % between busiest and least
                   busy expert" (P, 2) on the worst layers (A: spread ~ U(0.25, 1) x that),
                   step-to-step correlation 0.9 (A); the all-to-all itself is not modelled
mod                every other block routed, capacity 12.5 % (L: Raposo et al. 2024); the
                   realised fraction drifts (AR(1), std 0.05, correlation 0.9) because the paper
                   routes without future tokens (P, Fig. 1) (A: the numbers)
sparse_attention   hash-bucketed attention with 4 buckets (L: Pagliardini et al. 2023): a layer
                   computes the fraction sum_b p_b^2 of its causal score blocks, p_b its bucket
                   shares (softmax of AR(1) logits, per-layer std ~ U(0, 1.5), correlation 0.9:
                   A); attention costs that fraction of its measured dense time (M), the rest
                   of the block is unchanged
=================  ==========================================================================

Random draws are seeded; the same arguments give the same trajectory.

Modules: ``profile`` (the measured profile), ``snapshot`` (a GPT's per-layer costs from it),
``training`` (freezing, early exit, pruning: slow changes), ``routing`` (MoE, MoD, sparse
attention: per iteration), ``compare`` (static vs dynamic balancing in the simulator),
``repack`` (re-packing onto fewer ranks).
"""
from __future__ import annotations

from collections.abc import Callable

from .compare import (
    DYNAMIC,
    STATIC,
    Comparison,
    compare,
    inherent_bubble,
    megatron_gpt_layout,
    migration_seconds,
)
from .profile import DEFAULT_PROFILE, PROFILE_DIR, Profile, load_profile
from .repack import RepackProjection, repack_projection
from .routing import (  # noqa: F401 (_softmax)
    _softmax,
    logit_std_for_spread,
    mixture_of_depths,
    moe,
    sparse_attention,
)
from .snapshot import BYTES_PER_PARAM_STATE, Snapshot, gpt_snapshot
from .training import dense, early_exit, freezing, pruning, zhu_gupta

CASES: dict[str, Callable[..., list[Snapshot]]] = {
    "freezing": freezing,
    "early_exit": early_exit,
    "pruning": pruning,
    "moe": moe,
    "mod": mixture_of_depths,
    "sparse_attention": sparse_attention,
}
#: Cases whose routing changes every iteration (the paper invokes DynMo every iteration for them).
PER_ITERATION = ("moe", "mod", "sparse_attention")

__all__ = [
    "BYTES_PER_PARAM_STATE", "CASES", "DEFAULT_PROFILE", "DYNAMIC", "PER_ITERATION", "PROFILE_DIR", "STATIC",
    "Comparison", "Profile", "RepackProjection", "Snapshot", "compare", "dense", "early_exit", "freezing",
    "gpt_snapshot", "inherent_bubble", "load_profile", "logit_std_for_spread", "megatron_gpt_layout",
    "migration_seconds", "mixture_of_depths", "moe", "pruning", "repack_projection", "sparse_attention", "zhu_gupta",
]
