"""Reading a worker's rebalance history: partitions as ``rebalance_history.jsonl`` writes them."""
from __future__ import annotations


def boundary(partition: str) -> int:
    """The first layer of stage 1 of a 2-stage partition ``"0-2|3-8"``."""
    return int(partition.split("|")[1].split("-")[0])
