"""Mixture of Depths on the GPT: ``config`` (settings and their checks, no model code) and
``model`` (:class:`MoDBlock`, :class:`MoDGPT`)."""
from .config import GATES, ROUTING_MODES, MoDConfig, check_capacity, check_predictor_threshold
from .model import MoDBlock, MoDGPT

__all__ = ["GATES", "ROUTING_MODES", "MoDBlock", "MoDConfig", "MoDGPT", "check_capacity", "check_predictor_threshold"]
