"""Greedy verification: descend from the root to the child whose token is the target's
argmax at the parent. The jnp walk lives beside its Pallas kernel, the reference the kernel is
tested against (:mod:`pallas_kernels.verify_walk.reference`); the driver runs it from here."""

from pallas_kernels.verify_walk.reference import greedy_walk

__all__ = ["greedy_walk"]
