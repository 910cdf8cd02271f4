"""Draft trees: EAGLE-2 dynamic selection, static Medusa trees, and the arrays built from them."""

from jspec.tree.build import DraftTree, build_tree, chain_parents, pack_mask, unpack_mask
from jspec.tree.select import eagle2_tree, expand_frontier, select_tree
from jspec.tree.static import MC_SIM_7B_63, StaticTree, static_tree_tokens

__all__ = ["DraftTree", "build_tree", "chain_parents", "pack_mask", "unpack_mask", "eagle2_tree",
           "expand_frontier", "select_tree", "MC_SIM_7B_63", "StaticTree", "static_tree_tokens"]
