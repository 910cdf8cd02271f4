"""Tree attention over a paged KV cache (speculative-decoding verification).

Files: ``reference.py`` (pure jnp), ``kernel_tpu.py`` (Mosaic), ``kernel_gpu.py``
(Triton), ``block_sizes.py`` (block-size table), ``validate.py`` (static and
dynamic checks), ``layout.py`` (shared rearrangements), ``dispatch.py`` (entry).
"""

from pallas_kernels.tree_attention.dispatch import tree_attention
from pallas_kernels.tree_attention.reference import tree_attention_ref
from pallas_kernels.tree_attention.validate import check_dynamic, validate

__all__ = ["tree_attention", "tree_attention_ref", "validate", "check_dynamic"]
