"""Data modules for the pipeline examples and tests."""
from lightning_dynmo.data.text import ByteBlockDataset, ByteTextDataModule, load_text_bytes

__all__ = ["ByteTextDataModule", "ByteBlockDataset", "load_text_bytes"]
