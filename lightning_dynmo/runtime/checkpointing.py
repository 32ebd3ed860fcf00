"""Old name of :mod:`lightning_dynmo.runtime.recompute` (activation recomputation), kept only
while ``models/mod.py`` still imports it from here; new code imports ``runtime.recompute``."""
from .recompute import is_recomputing  # noqa: F401
