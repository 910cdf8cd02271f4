"""Medusa: K independent heads on the target's last hidden state, one call, no loop.

Head i is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` then an LM head (its own,
or the target's shared head), and predicts the token ``i + 2`` places after the
position whose hidden state it reads. In the driver that hidden state is the target's
at the last accepted node, whose own prediction is the bonus token (the tree root), so
head 0 proposes the root's children, head 1 the grandchildren, and so on.

The tree is static (:mod:`jspec.tree.static`): Medusa's 63-path ``mc_sim_7b_63`` by
default (truncated to the heads there are), a chain of the heads' top-1 tokens when
``topk == 1``, and otherwise the N-1 paths of the per-head top-K product with the
smallest rank sums (a deterministic stand-in for a calibrated tree).

Draft vocabulary (:mod:`jspec.drafters.vocab`): ``vocab_size`` is the own heads' width
(0: the target's shared head). A truncated vocabulary (vLLM; ``truncated=True``) keeps
``token_map [Vd]``: draft id -> target id (absolute, vLLM's convention, where the other
drafters keep ``d2t`` offsets; both are checked and mapped by the shared code).

Checkpoints: FasterDecoding ``{i}.{j}.linear.{weight,bias}`` and ``{i}.{L}.weight``;
vLLM ``blocks.{i}.layers.{j}.{weight,bias}`` and ``lm_heads.{i}.weight``.
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

import numpy as np

from jspec.checkpoint.common import CheckpointError
from jspec.config import LlamaConfig
from jspec.drafters import hf_layout as hf
from jspec.drafters.base import DrafterMismatchError, target_head
from jspec.drafters.protocol import DraftModuleDefaults
from jspec.drafters.registry import DrafterKind, register
from jspec.drafters.vocab import check_draft_vocab, check_token_map, to_target_ids
from jspec.shapes import Float
from jspec.spec_config import SpecConfig
from jspec.topk import top_k
from jspec.tree.static import MC_SIM_7B_63, StaticTree, static_tree_tokens


class MedusaHeads(nn.Module):
    num_heads: int
    num_layers: int
    hidden: int
    vocab: int            # 0: use the target's head
    dtype: str = "float32"

    @nn.compact
    def __call__(self, h, shared_head=None):
        outs = []
        for i in range(self.num_heads):
            x = h
            for j in range(self.num_layers):
                x = x + nn.silu(nn.Dense(self.hidden, dtype=self.dtype, param_dtype=self.dtype,
                                         kernel_init=nn.initializers.normal(0.02),
                                         name=f"head_{i}_block_{j}")(x))
            if self.vocab:
                logits = nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                  kernel_init=nn.initializers.normal(0.02), name=f"head_{i}_lm")(x)
            else:
                logits = x @ shared_head.astype(x.dtype)
            outs.append(logits.astype(jnp.float32))
        return jnp.stack(outs, axis=1)           # [B, heads, V]


@struct.dataclass
class MedusaState:
    feature: Float["B H"]    # the target's hidden state at the last accepted node


def default_tree_paths(num_heads: int, spec: SpecConfig | None):
    if spec is None:
        return tuple(p for p in MC_SIM_7B_63 if len(p) <= num_heads)
    if spec.num_steps > num_heads:
        raise DrafterMismatchError(
            f"medusa has {num_heads} heads, a tree of depth num_steps={spec.num_steps} needs that many")
    return StaticTree.for_spec(spec, num_heads).paths


@dataclasses.dataclass(frozen=True)
class Medusa(DraftModuleDefaults):
    num_heads: int
    num_layers: int
    hidden: int
    target_vocab: int
    vocab_size: int = 0           # own heads' vocabulary; 0 = the target's shared head
    truncated: bool = False       # own heads over a truncated vocab with a token_map
    dtype: str = "float32"
    kind = "medusa"
    map_key = "token_map"

    @property
    def draft_vocab(self) -> int:
        return self.vocab_size or self.target_vocab

    @property
    def draft_head_paths(self):
        if not self.vocab_size:
            return ()
        return tuple(("net", f"head_{i}_lm", "kernel") for i in range(self.num_heads))

    def to_target_ids(self, params, draft_ids):
        return to_target_ids(params, draft_ids)

    @property
    def net(self):
        return MedusaHeads(self.num_heads, self.num_layers, self.hidden, self.vocab_size, self.dtype)

    def tree(self, spec: SpecConfig | None) -> StaticTree:
        return StaticTree.from_paths(default_tree_paths(self.num_heads, spec))

    def check_spec(self, spec: SpecConfig | None) -> None:
        self.tree(spec)                # a tree deeper than the heads is refused there

    def tree_shape(self, spec: SpecConfig | None) -> tuple[int, int]:
        t = self.tree(spec)
        return t.depth, t.num_nodes

    def init_params(self, key, target_cfg: LlamaConfig):
        head = jnp.zeros((self.hidden, target_cfg.vocab_size), self.dtype)
        p = {"net": self.net.init(key, jnp.zeros((1, self.hidden), self.dtype), head)["params"]}
        if self.truncated:
            p["token_map"] = jnp.arange(self.vocab_size, dtype=jnp.int32)
        return p

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        if target_cfg.hidden_size != self.hidden:
            raise DrafterMismatchError(
                f"medusa heads have hidden size {self.hidden}, the target {target_cfg.hidden_size}")
        if target_cfg.vocab_size != self.target_vocab:
            raise DrafterMismatchError(
                f"medusa drafter was built for a vocabulary of {self.target_vocab} tokens, the "
                f"target has {target_cfg.vocab_size}")
        check_draft_vocab(self, target_cfg.vocab_size, params)

    def cache_slots(self, spec) -> int:
        return 0

    def init_state(self, batch, page_table, num_pages, page_size) -> MedusaState:
        return MedusaState(feature=jnp.zeros((batch, self.hidden), self.dtype))

    def _last(self, feats, n):
        idx = jnp.maximum(n - 1, 0)[:, None, None]
        return jnp.take_along_axis(feats, idx, axis=1)[:, 0]

    # kernels=: the protocol's attention mode; Medusa's heads do not attend.
    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference"):
        return MedusaState(feature=self._last(feats, lens).astype(self.dtype))

    def extend(self, params, target, state, feats, next_tokens, n, *, kernels: str = "reference"):
        return MedusaState(feature=jnp.where((n > 0)[:, None], self._last(feats, n).astype(self.dtype),
                                             state.feature))

    def propose(self, params, target, state: MedusaState, root, spec, *,
                kernels: str = "reference"):
        cfg, tparams = target
        tree = self.tree(spec)
        head = None if self.vocab_size else target_head(cfg, tparams)
        logits = self.net.apply({"params": params["net"]}, state.feature, head)  # [B, heads, V]
        _, top = top_k(logits[:, :tree.depth], tree.topk)
        top = self.to_target_ids(params, top)
        return static_tree_tokens(tree, root, top)


def _random(target_cfg: LlamaConfig, key, num_heads: int = 4, num_layers: int = 1,
            vocab_size: int = 0, truncated: bool | None = None):
    V = target_cfg.vocab_size
    if truncated is None:
        truncated = 0 < vocab_size < V
    module = Medusa(num_heads=num_heads, num_layers=num_layers, hidden=target_cfg.hidden_size,
                    target_vocab=V, vocab_size=vocab_size, truncated=truncated,
                    dtype=target_cfg.dtype)
    return module, module.init_params(key, target_cfg)


# ------------------------------------------------------------------ HF layouts
# {i}: head, {j}: residual block, {L}: number of blocks.
TABLES = {
    "fasterdecoding": ((("{i}.{j}.linear.weight", "head_{i}_block_{j}/kernel", True),
                        ("{i}.{j}.linear.bias", "head_{i}_block_{j}/bias", False)),
                       ("{i}.{L}.weight", "head_{i}_lm/kernel", True)),
    "vllm": ((("blocks.{i}.layers.{j}.weight", "head_{i}_block_{j}/kernel", True),
              ("blocks.{i}.layers.{j}.bias", "head_{i}_block_{j}/bias", False)),
             ("lm_heads.{i}.weight", "head_{i}_lm/kernel", True)),
}
LAYOUTS = tuple(TABLES)
_FD_KEY = re.compile(r"\d+\.\d+\.linear\.weight")


def _table(module: Medusa, layout, num_target_layers) -> list:
    block, lm = TABLES[layout]         # read by _read, or checked by _write_layout
    L = module.num_layers
    out = []
    for i in range(module.num_heads):
        for j in range(L):
            out += [(n.format(i=i, j=j), p.format(i=i, j=j), t) for n, p, t in block]
        if module.vocab_size:
            out.append((lm[0].format(i=i, L=L), lm[1].format(i=i), lm[2]))
    return hf.rows(out)


def _count(keys, pattern: str, part: int) -> int:
    return len({k.split(".")[part] for k in keys if re.fullmatch(pattern, k)})


def _read(d, ts: hf.Tensors, target: LlamaConfig, dtype: str):
    keys = ts.keys()
    layout = "vllm" if any(k.startswith(("blocks.", "lm_heads.")) for k in keys) else "fasterdecoding"
    if layout == "vllm":
        heads = hf.int_field(d, "medusa_num_heads", "num_heads",
                             default=_count(keys, r"lm_heads\.\d+\.weight", 1))
        layers = hf.int_field(d, "medusa_num_layers", "num_hidden_layers",
                              default=_count(keys, r"blocks\.0\.layers\.\d+\.weight", 3))
        lm0, blk0 = "lm_heads.0.weight", "blocks.0.layers.0.weight"
    else:
        heads = hf.int_field(d, "medusa_num_heads", default=_count(keys, r"\d+\..*", 0))
        layers = hf.int_field(d, "medusa_num_layers",
                              default=_count(keys, r"0\.\d+\.linear\.weight", 1))
        lm0, blk0 = f"0.{layers}.weight", "0.0.linear.weight"
    if not heads:
        raise CheckpointError(f"no Medusa heads found ({layout} layout)")
    hidden = hf.int_field(d, "hidden_size", default=ts.shape_or(
        blk0, 0, ts.shape_or(lm0, 1, target.hidden_size)))
    truncated_size = hf.int_field(d, "truncated_vocab_size")
    V = target.vocab_size
    if layout == "vllm":
        V = hf.int_field(d, "vocab_size", default=V)
    Vd = ts.shape_or(lm0, 0, truncated_size or V)
    if truncated_size is not None and truncated_size != Vd and lm0 in ts:
        raise CheckpointError(f"config field truncated_vocab_size={truncated_size} but tensor "
                              f"{lm0!r} predicts {Vd} tokens")
    extra = {}
    truncated = False
    if "token_map" in ts:
        shape = ts.shape("token_map")
        if shape != (Vd,):
            raise DrafterMismatchError(
                f"token_map has shape {shape}, expected ({Vd},) (one target id per draft id)")
        tm = np.asarray(ts.get("token_map")).astype(np.int64)
        check_token_map(tm, Vd, target.vocab_size)
        if not (Vd == target.vocab_size and np.array_equal(tm, np.arange(Vd))):
            truncated = True
            extra["token_map"] = jax.numpy.asarray(tm.astype(np.int32))
    elif Vd != V and truncated_size is not None:
        raise CheckpointError(f"config truncated_vocab_size={truncated_size} but the "
                              "checkpoint has no 'token_map' tensor")
    module = Medusa(num_heads=heads, num_layers=layers, hidden=hidden, target_vocab=V,
                    vocab_size=Vd, truncated=truncated, dtype=dtype)
    return module, extra, layout


def _write_layout(module: Medusa, layout):
    layout = layout or ("vllm" if module.truncated else "fasterdecoding")
    if layout not in TABLES:
        raise ValueError(f"medusa layout {layout!r}: one of {LAYOUTS}")
    if module.truncated and layout != "vllm":
        raise ValueError("a truncated-vocabulary Medusa drafter needs layout='vllm'")
    if not module.vocab_size:
        raise ValueError("Medusa heads without their own LM head have no HF layout")
    return layout


def _write_config(module: Medusa, layout, num_target_layers) -> dict:
    if layout == "vllm":
        return {"architectures": ["MedusaModel"], "model_type": "medusa",
                "hidden_size": module.hidden, "vocab_size": module.target_vocab,
                "num_heads": module.num_heads, "num_hidden_layers": module.num_layers,
                "truncated_vocab_size": module.vocab_size if module.truncated else None}
    return {"medusa_num_heads": module.num_heads, "medusa_num_layers": module.num_layers,
            "hidden_size": module.hidden}


def _detect_config(d: dict) -> bool:
    return "medusa_num_heads" in d or "medusa" in " ".join(d.get("architectures") or []).lower()


ENTRY = register(DrafterKind(
    name="medusa", module=Medusa, default_spec=None,       # Medusa's own 63-node tree
    build=_random,
    modes={"chain": lambda m: SpecConfig.chain(m.num_heads), "default": None},
    loss=("medusa", {"unroll": 1}),
    hf=hf.HFLayout(
        detect_keys=lambda ks: any(k.startswith(("blocks.", "lm_heads.")) or _FD_KEY.fullmatch(k)
                                   for k in ks),
        detect_config=_detect_config, read=_read, table=_table, write_config=_write_config,
        write_layout=_write_layout, layouts=LAYOUTS, priority=30),
    features="final"))
