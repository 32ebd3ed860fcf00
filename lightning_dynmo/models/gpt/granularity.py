"""What a GPT's pipeline layers are made of: whole blocks, or each block's two halves.

A balancer can only be as even as the pieces it moves. ``GPTConfig(pipeline_granularity=...)``:

* ``"block"`` (default): ``[Embedding] + [Block] * n_layer + [FinalNorm] + [Head]``;
* ``"sublayer"``: every block becomes two pipeline layers, its attention half
  (``x + attn(ln_1(x))``, :class:`AttentionHalf`) and its MLP half (``x + mlp(ln_2(x))``,
  :class:`MLPHalf`). Both map the hidden state to the hidden state, so the pipeline still passes
  one tensor; the two halves run exactly the operations of ``Block.forward`` in order, so the model
  computes the same function, bit for bit.
* ``"fine"``: five layers per (plain) block, cut inside the halves so a stage can end mid-attention
  or mid-MLP: LN 1 + QKV | attention core | output projection + residual | LN 2 + fc1 + GELU |
  fc2 + residual (:data:`FINE_PIECES`). A cut inside a half carries the intermediate *and* the
  residual stream, a tuple of two tensors (protocol/activations.py); the wider boundary is the cost
  model's to weigh (the simulator's ``granularity="fine"`` counts its bytes).

The halves hold the block's own submodules (``ln_1``, ``attn`` | ``ln_2``, ``mlp``), so parameter
objects, their order in ``parameters()`` (the optimizer's single-process positions) and their
initial values are the block model's. What differs is the pipeline index in the names
(``layers.{j}.``); :func:`apply_granularity` registers state-dict hooks on the model that write
and read the block model's keys (``layers.{block layer}.``), so a checkpoint never depends on the
granularity: one saved at either granularity resumes at the other, single-process or pipelined.
Inside a run (optimizer layout, migration, tied parameters) the real names are used;
:func:`state_dict_key` translates where a parameter's name meets a state-dict key.

``model.layer_units``: for each pipeline layer, the index of the block-granularity layer it
belongs to (its *unit*). Pieces of one unit are initialised from the unit's seed, in the block's
draw order (:func:`skip_draws`), and freezing treats a unit as one (``LayerFreezing`` never leaves
a block half frozen).

A block type opts in by defining ``split_sublayers() -> (first, second)`` (and ``split_fine()``);
:class:`Block` itself splits into the plain halves and the fine pieces. Models whose blocks route tokens around the
whole block (early exit, mixture of depths) refuse the sublayer granularity at construction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...protocol.row_draws import skip_normal
from .config import GRANULARITIES, check_granularity  # noqa: F401  (check_granularity: re-exported)
from .layers import Block

__all__ = [
    "FINE_PIECES",
    "GRANULARITIES",
    "check_granularity",
    "AttentionCore",
    "AttentionHalf",
    "AttentionIn",
    "AttentionOut",
    "MLPIn",
    "MLPOut",
    "MLPHalf",
    "apply_granularity",
    "check_block_granularity",
    "skip_draws",
    "split_block",
    "state_dict_key",
]

_LAYERS = "layers"  # the GPT's layer list: the prefix of its state-dict keys


class AttentionHalf(nn.Module):
    """A block's attention with its pre-norm and residual, ``x + attn(ln_1(x))``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln_1 = block.ln_1
        self.attn = block.attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln_1(x))


class MLPHalf(nn.Module):
    """A block's MLP with its pre-norm and residual, ``x + mlp(ln_2(x))``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln_2 = block.ln_2
        self.mlp = block.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln_2(x))


class _Part(nn.Module):
    """Holds some of a block's submodules under the block's names, so a piece's state-dict keys
    are the block's (``attn.qkv.weight``), whichever piece holds them."""

    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class AttentionIn(nn.Module):
    """LN 1 + QKV projection: ``x -> (qkv, x)`` (the residual stream rides along)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln_1 = block.ln_1
        self.attn = _Part(qkv=block.attn.qkv)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn.qkv(self.ln_1(x)), x.view_as(x)  # a view: the stream leaves with its own autograd node


class AttentionCore(nn.Module):
    """Causal SDPA over the heads: ``(qkv, x) -> (y, x)``, ``CausalSelfAttention.forward``'s middle."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.n_head, self.dropout = block.attn.n_head, block.attn.dropout

    def forward(self, qkv: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c3 = qkv.shape
        c = c3 // 3
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return y.transpose(1, 2).contiguous().view(b, t, c), x.view_as(x)


class AttentionOut(nn.Module):
    """Output projection + residual: ``(y, x) -> x + resid_drop(proj(y))``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.attn = _Part(proj=block.attn.proj, resid_drop=block.attn.resid_drop)

    def residual_projections(self) -> tuple[nn.Module, ...]:
        return (self.attn.proj,)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn.resid_drop(self.attn.proj(y))


class MLPIn(nn.Module):
    """LN 2 + fc1 + GELU: ``x -> (a, x)``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln_2 = block.ln_2
        self.mlp = _Part(fc=block.mlp.fc, act=block.mlp.act)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp.act(self.mlp.fc(self.ln_2(x))), x.view_as(x)


class MLPOut(nn.Module):
    """fc2 + residual: ``(a, x) -> x + drop(proj(a))``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.mlp = _Part(proj=block.mlp.proj, drop=block.mlp.drop)

    def residual_projections(self) -> tuple[nn.Module, ...]:
        return (self.mlp.proj,)

    def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp.drop(self.mlp.proj(a))


FINE_PIECES = (AttentionIn, AttentionCore, AttentionOut, MLPIn, MLPOut)


def split_block(block: nn.Module, granularity: str = "sublayer") -> tuple[nn.Module, ...]:
    """The pipeline layers that replace ``block`` at ``granularity`` ("sublayer" or "fine")."""
    method = "split_fine" if granularity == "fine" else "split_sublayers"
    split = getattr(block, method, None)
    if callable(split):
        return tuple(split())
    if type(block) is Block:
        if granularity == "fine":
            return tuple(piece(block) for piece in FINE_PIECES)
        return AttentionHalf(block), MLPHalf(block)
    hint = "'sublayer' or 'block'" if granularity == "fine" and callable(getattr(block, "split_sublayers", None)) \
        else "'block'"
    raise ValueError(
        f"{type(block).__name__} cannot be split into {granularity} pipeline layers (it defines no {method}()); "
        f"build the model with pipeline_granularity={hint}"
    )


def _draw_shapes(module: nn.Module) -> list[tuple[int, ...]]:
    """Shapes of the tensors ``GPT.init_pipeline_layer`` draws for ``module``, in draw order."""
    return [tuple(m.weight.shape) for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def skip_draws(gen: torch.Generator, layer: nn.Module) -> None:
    """Advance ``gen`` past the draws of the pieces before ``layer`` in its block, so that a piece
    initialised on its own gets the values the whole block gets from the same seed."""
    for shape in getattr(layer, "init_skip", ()):
        skip_normal(gen, shape)


def check_block_granularity(config, model: str, why: str) -> None:
    """Refuse, at construction, a model whose blocks cannot be split."""
    if config.pipeline_granularity != "block":
        raise ValueError(
            f"{model} does not support pipeline_granularity={config.pipeline_granularity!r}: {why}. "
            "Use pipeline_granularity='block'"
        )


def apply_granularity(model: nn.Module) -> None:
    """Make ``model.layers`` the pipeline layers of ``model.config.pipeline_granularity`` (called
    once, when the model's blocks are final) and set ``model.layer_units``."""
    layers = model.layers
    if model.config.pipeline_granularity == "block":
        model.layer_units = tuple(range(len(layers)))
        return
    pieces: list[nn.Module] = []
    units: list[int] = []
    for unit, layer in enumerate(layers):
        parts = split_block(layer, model.config.pipeline_granularity) if isinstance(layer, Block) else (layer,)
        before: list[tuple[int, ...]] = []
        for part in parts:
            part.init_skip = tuple(before)  # a plain attribute: it travels with the piece
            before += _draw_shapes(part)
            pieces.append(part)
            units.append(unit)
    model.layers = nn.ModuleList(pieces)
    model.layer_units = tuple(units)
    # (unit, key inside the piece) -> pipeline index, for loading block keys; also by the key's first
    # name component where that names one piece (keys a block gains later, e.g. lazily made buffers)
    model.piece_of_key = {(units[j], name): j for j, piece in enumerate(pieces) for name in piece.state_dict()}
    first: dict = {}
    for (unit, name), j in model.piece_of_key.items():
        first.setdefault((unit, name.split(".", 1)[0]), set()).add(j)
    model.piece_of_key.update({key: js.pop() for key, js in first.items()
                               if len(js) == 1 and key not in model.piece_of_key})
    model.register_state_dict_post_hook(_save_block_keys)
    model.register_load_state_dict_pre_hook(_load_block_keys)


def _split_key(key: str, head: str) -> tuple[int, str] | None:
    """``(index, rest)`` of ``head + "{index}.{rest}"``; None for other keys."""
    if not key.startswith(head):
        return None
    index, dot, rest = key[len(head):].partition(".")
    return (int(index), rest) if dot and index.isdigit() else None


def _rename(mapping: dict, rename) -> None:
    """Rename the keys of ``mapping`` in place, keeping their order."""
    items = list(mapping.items())
    mapping.clear()
    for key, value in items:
        mapping[rename(key)] = value


def _to_block_key(model: nn.Module, key: str, prefix: str) -> str:
    head = f"{prefix}{_LAYERS}."
    found = _split_key(key, head)
    if found is None or found[0] >= len(model.layer_units):
        return key
    return f"{head}{model.layer_units[found[0]]}.{found[1]}"


def _to_piece_key(model: nn.Module, key: str, prefix: str) -> str:
    head = f"{prefix}{_LAYERS}."
    found = _split_key(key, head)
    if found is None:
        return key
    unit, rest = found
    j = model.piece_of_key.get((unit, rest), model.piece_of_key.get((unit, rest.split(".", 1)[0])))
    return key if j is None else f"{head}{j}.{rest}"


def _save_block_keys(model, state_dict, prefix, local_metadata) -> None:
    _rename(state_dict, lambda k: _to_block_key(model, k, prefix))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-module versions, under the block model's module names
        _rename(metadata, lambda k: _to_block_key(model, k + ".", prefix)[:-1])


def _load_block_keys(model, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
    # ``state_dict`` is load_state_dict's own copy; its ``_metadata`` is the caller's and stays
    # as it is (our modules' loading does not depend on their version)
    _rename(state_dict, lambda k: _to_piece_key(model, k, prefix))


def state_dict_key(module: nn.Module, name: str) -> str:
    """The key under which ``module.state_dict()`` saves the tensor ``named_parameters()`` /
    ``named_buffers()`` call ``name`` (the same unless the module is split into sublayers)."""
    units = getattr(module, "layer_units", None)
    if units is None or not getattr(module, "piece_of_key", None):
        return name
    return _to_block_key(module, name, "")
