"""How finely a model may be cut into pipeline layers: the names every side agrees on (the GPT
and Hugging Face models, and the paper-scale simulator), checked in one place."""
from __future__ import annotations

#: whole transformer blocks; attention and MLP halves; five pieces per block (models/gpt/granularity.py)
GRANULARITIES = ("block", "sublayer", "fine")


def check_head_chunks(head_chunks: int, vocab_size: int | None = None) -> None:
    """``head_chunks`` (the LM head + loss as that many pipeline layers over vocabulary slices):
    an integer from 1 to the vocabulary size, where that is known."""
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1 or \
            (vocab_size is not None and head_chunks > vocab_size):
        span = f"between 1 and vocab_size={vocab_size}" if vocab_size is not None else ">= 1"
        raise ValueError(f"head_chunks must be an integer {span} (the LM head's vocabulary chunks), "
                         f"got {head_chunks!r}")


def check_granularity(pipeline_granularity: str, head_chunks: int, vocab_size: int | None = None) -> None:
    """The one check of ``pipeline_granularity`` and ``head_chunks`` (GPTConfig, the simulator)."""
    if pipeline_granularity not in GRANULARITIES:
        raise ValueError(f"pipeline_granularity must be one of {', '.join(GRANULARITIES)}, "
                         f"got {pipeline_granularity!r}")
    check_head_chunks(head_chunks, vocab_size)
