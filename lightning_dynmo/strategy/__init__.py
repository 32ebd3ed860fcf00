"""The Lightning layer: the strategy and the adapters that wire plan/ and runtime/ into it."""
from .strategy import DynMoStrategy

__all__ = ["DynMoStrategy"]
