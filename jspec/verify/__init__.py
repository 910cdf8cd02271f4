"""Verification: walk a draft tree against the target, keep the longest valid path."""

from jspec.verify.commit import commit_accepted, emitted_tokens
from jspec.verify.greedy import greedy_walk
from jspec.verify.sampling import chain_sample_walk, tree_sample_walk

__all__ = ["commit_accepted", "emitted_tokens", "greedy_walk", "chain_sample_walk",
           "tree_sample_walk"]
