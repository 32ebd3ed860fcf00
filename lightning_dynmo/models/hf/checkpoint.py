"""Checkpoint files of the Hugging Face adapter: where each module tensor lives on disk, read per
layer, and the on-disk format ``save_pretrained`` writes back.

A module tensor (named as in ``AutoModelForCausalLM.state_dict()``) is found in the checkpoint
as, in this order:

* the same key, or the key without the base-model prefix (``model.``/``transformer.``, as a bare
  ``AutoModel`` checkpoint stores it);
* its **on-disk layout** (:data:`DISK_LAYOUTS`), for architectures whose ``transformers`` 5
  modules differ from the published files. Mixtral's experts are fused module tensors
  (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) but are stored
  per expert under the pre-v5 names (``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, ``[I, H]``
  and ``[H, I]``): Hub checkpoints hold that format and ``transformers`` 5 ``save_pretrained``
  writes it too (it reverts its load-time conversion). The table mirrors
  ``transformers.conversion_mapping`` (``"mixtral"``: rename ``.block_sparse_moe.`` -> ``.mlp.``;
  ``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=1)`` joins w1 (gate) and w3
  (up)), applied here per tensor so that a rank reads only its own layers;
* a tied LM head: the token embedding.

Shapes are checked from the file headers before anything is read (per stored tensor, so a
per-expert mismatch names the file's tensor), and so are layers on disk beyond the config's
``num_hidden_layers`` (a config with fewer layers than its weights). A file that cannot be read
(truncated, damaged) fails with :class:`CheckpointFileError` naming the file.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DISK_LAYOUTS", "CheckpointFileError", "CheckpointFiles", "CheckpointReader", "DiskLayout", "Source"]


class CheckpointFileError(OSError):
    """A checkpoint file that cannot be read (truncated or damaged); the message names the file."""


@contextmanager
def _reading(file: Path):
    """Errors of the safetensors/torch readers, which do not say which file, name it."""
    try:
        yield
    except (FileNotFoundError, KeyError):
        raise
    except Exception as err:  # noqa: BLE001 - SafetensorError, RuntimeError, EOFError, UnpicklingError...
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointFileError(
            f"{file} cannot be read ({type(err).__name__}: {first_line}); "
            "it is truncated or damaged: download or save it again"
        ) from err


def _safe_open(file: Path):
    from safetensors import safe_open

    with _reading(file):
        return safe_open(str(file), framework="pt")


@dataclass(frozen=True)
class DiskLayout:
    """How an architecture's module tensors are named and split in its published files.

    ``renames``: ``(module infix, disk infix)`` pairs. ``fused``: ``(module suffix, per-expert
    disk suffixes with {e})``: the module tensor ``[E, n * d0, d1]`` is the concatenation along
    dim 1 of the ``n`` suffixes' tensors ``[d0, d1]``, each stacked over the ``E`` experts."""

    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def disk_name(self, key: str) -> str:
        for module, disk in self.renames:
            key = key.replace(module, disk)
        return key

    def fused_parts(self, key: str) -> tuple[str, tuple[str, ...]] | None:
        """``(disk prefix, per-expert suffixes)`` when ``key`` is a fused module tensor."""
        for suffix, parts in self.fused:
            if key.endswith("." + suffix):
                return self.disk_name(key[: -len(suffix)]), parts
        return None

    def to_disk(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module tensors -> the published file's tensors (the inverse of :meth:`Source.assemble`)."""
        out: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            fused = self.fused_parts(key)
            if fused is None:
                out[self.disk_name(key)] = value
                continue
            prefix, parts = fused
            for part, chunk in zip(parts, value.chunk(len(parts), dim=1)):
                for e, t in enumerate(chunk.unbind(0)):
                    out[prefix + part.format(e=e)] = t.contiguous()
        return out


DISK_LAYOUTS: dict[str, DiskLayout] = {
    "mixtral": DiskLayout(
        renames=((".mlp.", ".block_sparse_moe."),),
        fused=(("experts.gate_up_proj", ("experts.{e}.w1.weight", "experts.{e}.w3.weight")),
               ("experts.down_proj", ("experts.{e}.w2.weight",))),
    ),
    # transformers 5 names GPT-NeoX's head lm_head; Pythia's files (and its save_pretrained) say embed_out
    "gpt_neox": DiskLayout(renames=(("lm_head.", "embed_out."),)),
}
_NO_LAYOUT = DiskLayout()


@dataclass(frozen=True)
class Source:
    """Where one module tensor of shape ``shape`` is stored: one key (``parts == 0``), or
    ``parts`` per-expert tensors per expert, expert-major within each part."""

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    parts: int = 0

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        if not self.parts:
            return {self.keys[0]: self.shape}
        _, rows, cols = self.shape
        return {k: (rows // self.parts, cols) for k in self.keys}

    def assemble(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not self.parts:
            return tensors[self.keys[0]]
        per_part = len(self.keys) // self.parts
        stacks = [torch.stack([tensors[k] for k in self.keys[p * per_part:(p + 1) * per_part]])
                  for p in range(self.parts)]
        return torch.cat(stacks, dim=1)


class CheckpointFiles:
    """Tensors of a local Hugging Face checkpoint directory (``model.safetensors``, a sharded
    index, or ``pytorch_model.bin``), read a few at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.files: dict[str, Path] = {}
        index = next((path / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (path / n).exists()), None)
        if index is not None:
            for key, name in json.loads(index.read_text())["weight_map"].items():
                self.files[key] = path / name
        else:
            single = next((path / n for n in ("model.safetensors", "pytorch_model.bin") if (path / n).exists()), None)
            if single is None:
                raise FileNotFoundError(
                    f"{path} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
                )
            for key in self._keys_of(single):
                self.files[key] = single
        self._bins: dict[Path, dict] = {}

    def _keys_of(self, file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            with _safe_open(file) as f:
                return list(f.keys())
        return list(self._bin(file))

    def _bin(self, file: Path) -> dict:
        if file not in self._bins:
            with _reading(file):
                self._bins[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        return self._bins[file]

    def _by_file(self, keys) -> dict[Path, list[str]]:
        out: dict[Path, list[str]] = {}
        for k in keys:
            out.setdefault(self.files[k], []).append(k)
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for file, keys in self._by_file(self.files).items():
            if file.suffix == ".safetensors":
                with _safe_open(file) as f, _reading(file):
                    out.update({k: tuple(f.get_slice(k).get_shape()) for k in keys})
            else:
                sd = self._bin(file)
                out.update({k: tuple(sd[k].shape) for k in keys})
        return out

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for file, ks in self._by_file(keys).items():
            if file.suffix == ".safetensors":
                with _safe_open(file) as f, _reading(file):
                    out.update({k: f.get_tensor(k) for k in ks})
            else:
                sd = self._bin(file)
                out.update({k: sd[k] for k in ks})
        return out


class CheckpointReader(CheckpointFiles):
    """:class:`CheckpointFiles` that finds each module tensor's :class:`Source` (see the module
    docstring). ``tied_head``: ``(head key, embedding key)`` when the LM head may be stored as the
    embedding only."""

    def __init__(self, path: Path, layout: DiskLayout | None = None, tied_head: tuple[str, str] | None = None):
        super().__init__(path)
        self.layout = layout or _NO_LAYOUT
        self.tied_head = tied_head

    def _lookup(self, key: str) -> str | None:
        if key in self.files:
            return key
        head, _, short = key.partition(".")
        if short in self.files and head in ("transformer", "model"):
            return short
        return None

    def source(self, key: str, shape: tuple[int, ...]) -> Source | None:
        """Where module tensor ``key`` of ``shape`` is stored (``None``: nowhere)."""
        shape = tuple(shape)
        found = self._lookup(key)
        if found is not None:
            return Source((found,), shape)
        fused = self.layout.fused_parts(key)
        if fused is not None and len(shape) == 3:
            prefix, parts = fused
            keys = [self._lookup(prefix + part.format(e=e)) for part in parts for e in range(shape[0])]
            if all(k is not None for k in keys):
                return Source(tuple(keys), shape, parts=len(parts))
        elif fused is None and (found := self._lookup(self.layout.disk_name(key))) is not None:
            return Source((found,), shape)
        if self.tied_head is not None and key == self.tied_head[0]:
            return self.source(self.tied_head[1], shape)
        return None

    def mismatches(self, expected: Mapping[str, tuple[int, ...]]) -> tuple[list[str], list[str]]:
        """``(missing module keys, "file key: checkpoint [..], config [..]" lines)`` for the module
        tensors ``expected`` (key -> shape), from the file headers only."""
        shapes = self.shapes()
        missing, wrong = [], []
        for key, shape in expected.items():
            src = self.source(key, shape)
            if src is None:
                missing.append(key)
                continue
            for k, want in src.expected_shapes().items():
                if tuple(shapes[k]) != tuple(want):
                    wrong.append(f"{k}: checkpoint {list(shapes[k])}, config {list(want)}")
        return missing, wrong

    def extra_layer_keys(self, layers_prefix: str, num_layers: int) -> list[str]:
        """The file's tensors of layers ``num_layers`` and beyond under ``layers_prefix`` (e.g.
        ``model.layers``; also without its base-model prefix): weights the config would drop."""
        short = layers_prefix.partition(".")[2]
        pattern = re.compile(rf"^(?:{re.escape(layers_prefix)}|{re.escape(short or layers_prefix)})\.(\d+)\.")
        return sorted((k for k in self.files if (m := pattern.match(k)) and int(m.group(1)) >= num_layers),
                      key=lambda k: (int(pattern.match(k).group(1)), k))

    def load(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The module tensors ``expected`` (key -> shape), reading only what they need."""
        sources = {key: self.source(key, shape) for key, shape in expected.items()}
        tensors = self.read(sorted({k for s in sources.values() for k in s.keys}))
        return {key: s.assemble(tensors) for key, s in sources.items()}
