"""Byte-level language-modelling data (vocab 256) that works offline everywhere.

Default corpus: the help topics shipped in the standard library (``pydoc_data.topics``), so
examples and tests never need a download. A user's file or folder can replace it.
"""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["ByteTextDataModule", "ByteBlockDataset", "load_text_bytes", "default_text_bytes"]

TEXT_SUFFIXES = (".txt", ".md")


def default_text_bytes() -> bytes:
    """The values of ``pydoc_data.topics.topics`` in sorted-key order, UTF-8 (~465k chars)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def load_text_bytes(path: str | Path | None = None) -> bytes:
    """Raw bytes of ``path`` (a file, or every ``*.txt``/``*.md`` under a folder, sorted).

    Folder files are joined with a newline so one file's end does not run into the next's start.
    """
    if path is None:
        data = default_text_bytes()
        source = "pydoc_data.topics"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"text path does not exist: {p}")
        if p.is_dir():
            files = sorted(
                f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
            )
            if not files:
                raise ValueError(f"no *.txt or *.md files found under folder {p}")
            data = b"\n".join(f.read_bytes() for f in files)
        else:
            data = p.read_bytes()
        source = str(p)
    if not data.strip():
        raise ValueError(f"text source {source} is empty")
    return data


class ByteBlockDataset(Dataset):
    """Windows of ``block_size + 1`` bytes every ``stride`` bytes: ``(x, y)`` with y = x shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None):
        if data.dim() != 1:
            raise ValueError("data must be a 1-D tensor of token ids")
        self.data = data
        self.block_size = int(block_size)
        self.stride = int(stride or block_size)
        if self.block_size <= 0 or self.stride <= 0:
            raise ValueError("block_size and stride must be positive")
        if len(data) < self.block_size + 1:
            raise ValueError(
                f"text of {len(data)} bytes is shorter than block_size + 1 = {self.block_size + 1}"
            )

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(L.LightningDataModule):
    """Byte-level next-token data; the last ``val_fraction`` of the bytes is validation.

    ``stride`` (default ``block_size``) applies to training windows; validation windows never
    overlap, so val loss does not depend on ``stride``. The train loader shuffles with a seeded
    generator and is a plain ``DataLoader`` so Lightning can inject a ``DistributedSampler``.
    """

    vocab_size = 256

    def __init__(
        self,
        path: str | Path | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        shuffle_seed: int = 1234,
        stride: int | None = None,
    ):
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if block_size <= 0 or batch_size <= 0:
            raise ValueError("block_size and batch_size must be positive")
        self.save_hyperparameters()
        self.path = path
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.val_fraction = float(val_fraction)
        self.num_workers = int(num_workers)
        self.shuffle_seed = int(shuffle_seed)
        self.stride = int(stride) if stride else self.block_size
        self.train_dataset: ByteBlockDataset | None = None
        self.val_dataset: ByteBlockDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        raw = load_text_bytes(self.path)
        if len(raw) < self.block_size + 1:
            raise ValueError(
                f"text has {len(raw)} bytes, shorter than block_size + 1 = {self.block_size + 1}"
            )
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_val = int(len(data) * self.val_fraction)
        n_train = len(data) - n_val
        need = self.block_size + 1
        if n_train < need or n_val < need:
            raise ValueError(
                f"text of {len(data)} bytes split into train={n_train} / val={n_val} bytes, but "
                f"each split needs at least block_size + 1 = {need}; use more text, a smaller "
                f"block_size or a different val_fraction"
            )
        self.train_dataset = ByteBlockDataset(data[:n_train], self.block_size, self.stride)
        self.val_dataset = ByteBlockDataset(data[n_train:], self.block_size, self.block_size)

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        if len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"only {len(self.train_dataset)} training windows, fewer than batch_size="
                f"{self.batch_size} (drop_last would leave no batches)"
            )
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.shuffle_seed),
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        """Token ids back to text (invalid UTF-8 sequences replaced), e.g. for ``GPT.generate``."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.flatten().tolist()
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """Text to int64 byte ids ``[1, T]`` (a prompt for ``GPT.generate``)."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long).unsqueeze(0)
