"""The measured per-layer profile of the paper's GPT that every scenario starts from (see the
package docstring for what it holds and where it was measured), and its FLOP-count fallback."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "h100_gpt_h1024_s2048_mb2"


def _isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): timing noise must not make
    a layer cheaper with more tokens."""
    blocks: list[list[float]] = []  # [mean, weight]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * w2 + m1 * w1) / (w2 + w1), w2 + w1]
    out: list[float] = []
    for m, w in blocks:
        out.extend([m] * int(w))
    return out


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear in ``x``; constant below the table, linear extrapolation above it."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True)
class Profile:
    """Seconds per micro-batch of the GPT's layers (see the package docstring)."""

    name: str
    source: str  # device and how it was obtained
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    vocab: int
    fractions: tuple[float, ...]  # token fractions of the block rows, ascending
    block_fwd: tuple[float, ...]
    block_bwd: tuple[float, ...]
    block_bwd_weights: tuple[float, ...]  # backward without the input gradient
    attn_fwd: tuple[float, ...]  # causal attention alone, same fractions
    attn_bwd: tuple[float, ...]
    mlp_tokens: tuple[float, ...]  # LN + MLP alone at token counts, ascending
    mlp_fwd: tuple[float, ...]
    mlp_bwd: tuple[float, ...]
    embedding: tuple[float, float]
    final_norm: tuple[float, float]
    head: tuple[float, float]  # LM head + fp32 cross-entropy
    params: dict = field(default_factory=dict)  # block, embedding, final_norm, head

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch * self.seq

    @property
    def boundary_bytes(self) -> float:
        """The bf16 activation a stage sends per micro-batch (and its gradient back)."""
        return 2.0 * self.tokens * self.hidden

    @property
    def stored_block_bytes(self) -> float:
        """Activations a block keeps for backward per micro-batch: 34 s b h bytes (Korthikanti
        et al. 2022, bf16, flash attention so no s^2 term)."""
        return 34.0 * self.tokens * self.hidden

    @property
    def stored_head_bytes(self) -> float:
        """The head keeps bf16 logits and their fp32 copy for the loss."""
        return 6.0 * self.tokens * self.vocab

    @classmethod
    def load(cls, name_or_path: str | Path = DEFAULT_PROFILE) -> "Profile":
        """A bundled profile by name (``profiles/<name>.json``) or a JSON file from
        ``benchmarks/block_profile.py``."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            bundled = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise FileNotFoundError(f"no profile {name_or_path!r}; bundled: {bundled} (or pass a JSON path)")
        d = json.loads(path.read_text())
        ms = 1e-3
        b, a, m = d["block"], d["attention_core"], d["mlp"]

        def fit(xs, ys):
            order = sorted(range(len(xs)), key=lambda i: xs[i])
            return tuple(xs[i] for i in order), tuple(ms * y for y in _isotonic([ys[i] for i in order]))

        fr, bf = fit(b["fractions"], b["forward_ms"])
        _, bb = fit(b["fractions"], b["backward_ms"])
        _, bw = fit(b["fractions"], b["backward_weights_only_ms"])
        afr, af = fit(a["fractions"], a["forward_ms"])
        _, ab = fit(a["fractions"], a["backward_ms"])
        if afr != fr:
            raise ValueError(f"{path}: block and attention rows need the same fractions")
        mt, mf = fit(m["tokens"], m["forward_ms"])
        _, mb = fit(m["tokens"], m["backward_ms"])
        pair = lambda k: (ms * d[k]["forward_ms"], ms * d[k]["backward_ms"])  # noqa: E731
        return cls(
            name=path.stem, source=f"measured: {d.get('device')} ({d.get('dtype')}, torch {d.get('torch')}; "
            "benchmarks/block_profile.py)", hidden=d["hidden"], heads=d["heads"], seq=d["seq"],
            micro_batch=d["micro_batch"], vocab=d["vocab"], fractions=fr, block_fwd=bf, block_bwd=bb,
            block_bwd_weights=bw, attn_fwd=af, attn_bwd=ab, mlp_tokens=mt, mlp_fwd=mf, mlp_bwd=mb,
            embedding=pair("embedding"), final_norm=pair("final_norm"), head=pair("head_loss"),
            params=dict(d.get("params", {})),
        )

    @classmethod
    def from_flops(cls, hidden: int = 1024, heads: int = 32, seq: int = 2048, micro_batch: int = 2,
                   vocab: int = 50304, flops_per_second: float = 4e14) -> "Profile":
        """No measurement: forward FLOPs at one effective rate (default 40 % of an H100's dense
        bf16 peak), backward 2x forward (weights-only backward 1x). Block: QKV/output 8 b s h^2,
        MLP 16 b s h^2, causal attention 2 b s^2 h (half of the 4 b s^2 h square); all linear in
        the token count except attention (quadratic)."""
        t = micro_batch * seq
        fr = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0)

        def sec(flops):
            return flops / flops_per_second

        dense = [sec(24 * f * t * hidden**2) for f in fr]
        attn = [sec(2 * (f * seq) ** 2 * micro_batch * hidden) for f in fr]
        toks = (512.0, 4096.0, 32768.0)
        mlp = [sec(16 * n * hidden**2) for n in toks]
        return cls(
            name="flops", source=f"FLOP model at {flops_per_second:.3g} FLOP/s (not measured)", hidden=hidden,
            heads=heads, seq=seq, micro_batch=micro_batch, vocab=vocab, fractions=fr,
            block_fwd=tuple(d + a for d, a in zip(dense, attn)),
            block_bwd=tuple(2 * (d + a) for d, a in zip(dense, attn)),
            block_bwd_weights=tuple(d for d in dense), attn_fwd=tuple(attn), attn_bwd=tuple(2 * a for a in attn),
            mlp_tokens=toks, mlp_fwd=tuple(mlp), mlp_bwd=tuple(2 * x for x in mlp),
            embedding=(sec(t * hidden), sec(2 * t * hidden)), final_norm=(sec(5 * t * hidden), sec(10 * t * hidden)),
            head=(sec(2 * t * hidden * vocab), sec(4 * t * hidden * vocab)),
            params={"block": 12 * hidden**2 + 13 * hidden, "embedding": (vocab + seq) * hidden,
                    "final_norm": 2 * hidden, "head": vocab * hidden},
        )

    # seconds per micro-batch -------------------------------------------------------------
    def block(self, fraction: float = 1.0) -> tuple[float, float]:
        """(forward, backward) of a block that runs on ``fraction`` of the tokens (packed)."""
        return _interp(self.fractions, self.block_fwd, fraction), _interp(self.fractions, self.block_bwd, fraction)

    def block_weights_only_backward(self, fraction: float = 1.0) -> float:
        return _interp(self.fractions, self.block_bwd_weights, fraction)

    def attention(self, fraction: float = 1.0) -> tuple[float, float]:
        return _interp(self.fractions, self.attn_fwd, fraction), _interp(self.fractions, self.attn_bwd, fraction)

    def mlp(self, tokens: float) -> tuple[float, float]:
        """(forward, backward) of LN + MLP on ``tokens`` tokens (0 tokens: nothing runs)."""
        if tokens <= 0:
            return 0.0, 0.0
        return _interp(self.mlp_tokens, self.mlp_fwd, tokens), _interp(self.mlp_tokens, self.mlp_bwd, tokens)

    def block_params(self) -> int:
        return int(self.params.get("block", 12 * self.hidden**2 + 13 * self.hidden))

    def mlp_params(self) -> int:
        """One MLP (an MoE expert): fc1 and fc2 with biases."""
        return 8 * self.hidden**2 + 5 * self.hidden

    def mlp_half_params(self) -> int:
        """A block's MLP half: its LayerNorm and MLP (the attention half holds the rest)."""
        return self.mlp_params() + 2 * self.hidden


@lru_cache(maxsize=8)
def load_profile(name: str = DEFAULT_PROFILE) -> Profile:
    return Profile.from_flops() if name == "flops" else Profile.load(name)
