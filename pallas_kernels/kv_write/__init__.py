"""A block's keys and values written into the paged KV pools.

Files: ``reference.py`` (one jnp scatter per pool), ``kernel_tpu.py`` (Mosaic: aligned
read-modify-write DMAs). On GPU and CPU the scatter is what XLA runs well; on TPU the
kernel replaces the seven kernels XLA makes of the scatters (see ``kernel_tpu.py``).
"""

from pallas_kernels.kv_write.kernel_tpu import MAX_TOKENS, kv_write_tpu, row_group, validate
from pallas_kernels.kv_write.reference import kv_write_ref

__all__ = ["kv_write_tpu", "kv_write_ref", "row_group", "validate", "MAX_TOKENS"]
