"""Sparse kernels that make dynamic sparsity pay: CSR SpMM/SDDMM behind sparse linear layers
(with a measured dense-vs-sparse dispatch so pruning never slows a layer), and block-sparse
causal attention with hash-based dynamic layouts."""
from ._ops import cuda_kernels_available, extension_available, extension_error
from .attention import attention_kernel_available, block_sparse_attention, reference_block_sparse_attention
from .backend_choice import attention_choices
from .dispatch import LINEAR_KERNELS, choose_linear_kernel, crossover_density, maybe_sparsify
from .layout import BlockLayout
from .hash_layout import (HashPlan, draw_rotations, hash_buckets, hash_sort_plan, hash_sparse_attention,
                          local_window_layout)
from .linear import MaskedLinear, SparseLinear
from .semi_structured import semi_structured_linear, semi_structured_unavailable

__all__ = ["SparseLinear", "MaskedLinear", "maybe_sparsify", "crossover_density", "choose_linear_kernel",
           "LINEAR_KERNELS",
           "semi_structured_linear", "semi_structured_unavailable",
           "extension_available", "extension_error", "cuda_kernels_available",
           "BlockLayout", "block_sparse_attention", "reference_block_sparse_attention",
           "attention_kernel_available", "HashPlan", "draw_rotations", "hash_buckets",
           "hash_sort_plan", "hash_sparse_attention", "local_window_layout", "attention_choices"]
