"""Verify walk kernels: greedy and tree rejection sampling over a draft tree.

See :mod:`pallas_kernels.verify_walk.kernel` for the layouts and
:mod:`pallas_kernels.verify_walk.dispatch` for the entry points and validation.
"""

from pallas_kernels.verify_walk.dispatch import (from_tree, validate_greedy, validate_sample,
                                                 verify_walk_greedy, verify_walk_sample)
from pallas_kernels.verify_walk.reference import (greedy_walk_ref, parents_from_lists,
                                                  sample_walk_ref)

__all__ = ["verify_walk_greedy", "verify_walk_sample", "validate_greedy", "validate_sample",
           "greedy_walk_ref", "sample_walk_ref", "parents_from_lists", "from_tree"]
