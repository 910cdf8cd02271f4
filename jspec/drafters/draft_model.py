"""An independent draft model: any Llama-family checkpoint that shares the target's
tokenizer, drafting from its own tokens and its own paged KV cache (transformers'
assisted generation, vLLM's draft model, SGLang's standalone mode).

It reads nothing of the target's states (``features`` are the target's input tokens, used
once: the prompt's first token) and runs the shared EAGLE-2 loop of
:class:`~jspec.drafters.base.RecurrentDrafter` over its whole decoder stack: chains, and
dynamic trees ranked by its own path probabilities.

Cache positions: its KV slot ``j`` holds token ``j``, so its committed length is the
target's plus one (the recurrent drafters' pairs (feature i, token i+1) never feed token 0;
a language model needs its first token, the attention sink of Llama-family models).
:meth:`DraftModel.cache_slots` asks for that extra slot.

Parameters are the target checkpoints' own layout (``embed_tokens``, ``layers_{i}``,
``norm``, ``lm_head`` unless tied), so any checkpoint :func:`jspec.load_target` reads is a
draft model: ``--drafter model:PATH``, or ``load_drafter(PATH, cfg, kind="model")``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.drafters.base import DrafterMismatchError, RecurrentDrafter, kept_rows
from jspec.drafters.registry import DrafterKind, register
from jspec.kernels import attention_fn
from jspec.llama import DecoderLayer, RMSNorm, dense
from jspec.serving_layout import linear, precision
from jspec.spec_config import SpecConfig

PROBE = "def f(x):\n    return x + 1  # Once upon a time, 12345."


class DraftModelNet(nn.Module):
    cfg: LlamaConfig
    kernels: str = "reference"         # the attention's jspec.kernels mode
    out_major: bool = False            # kernels held [out, in] (serving; see Linear)

    @nn.compact
    def __call__(self, tokens, positions, cache, block_mask, valid, offset, keep=None):
        c = self.cfg
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.dtype,
                         embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
        x = embed(tokens)
        for i in range(c.num_layers):
            x, cache = DecoderLayer(c, self.out_major, name=f"layers_{i}")(
                x, positions, cache, i, block_mask, valid, attention_fn(self.kernels), offset)
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype, name="norm")(kept_rows(x, keep))
        if c.tie_word_embeddings:           # [V, H]: the output-major product
            logits = linear(h, embed.embedding.astype(h.dtype), precision(c))
        else:
            logits = dense(c.vocab_size, ("embed", "vocab"), c, "lm_head", self.out_major)(h)
        return x, logits.astype(jnp.float32), cache


@dataclasses.dataclass(frozen=True)
class DraftModel(RecurrentDrafter):
    """``layer`` is the draft model's whole config (all its layers)."""
    kind = "model"
    prefill_is_extend = False       # its prefill feeds the prompt's first token too

    @property
    def cache_layers(self) -> int:
        return self.layer.num_layers

    def net(self, kernels: str = "reference") -> DraftModelNet:
        return DraftModelNet(self.layer, kernels, self.out_major)

    def init_params(self, key, target_cfg: LlamaConfig):
        _, _, pos, cache = self._dummy(target_cfg, 1)
        tok = jnp.zeros((1, 1), jnp.int32)
        return {"net": nn.unbox(self.net().init(key, tok, pos, cache, None, None, 0)["params"])}

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        if target_cfg.vocab_size != self.target_vocab or self.layer.vocab_size != self.target_vocab:
            raise DrafterMismatchError(
                f"draft model has a vocabulary of {self.layer.vocab_size} tokens, the target "
                f"{target_cfg.vocab_size}: a draft model must share the target's tokenizer")

    def features(self, hidden, aux, tokens):
        return tokens[..., None]

    def cache_slots(self, spec: SpecConfig) -> int:
        return super().cache_slots(spec) + 1          # its KV also holds the first token

    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset, keep=None, *, kernels: str = "reference"):
        return self.net(kernels).apply({"params": params["net"]}, tokens, positions, cache,
                                       block_mask, valid, offset, keep)

    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference"):
        # feats [B, T, 1] are the prompt's tokens: feed token 0, then the shifted prompt.
        tokens = jnp.concatenate([feats[:, :1, 0].astype(next_tokens.dtype), next_tokens], 1)
        return self._run_committed(params, target, state, None, tokens, lens + 1, kernels)


def check_tokenizers(target, draft) -> None:
    """Both tokenizers (where both checkpoints ship one) must agree on a probe text."""
    a, b = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if a is None or b is None:
        return
    if a.encode(PROBE) != b.encode(PROBE):
        raise DrafterMismatchError(
            "draft model's tokenizer encodes text differently from the target's: it must share "
            f"the target's tokenizer (probe {PROBE!r})")


def from_target(draft, target_cfg: LlamaConfig) -> tuple[DraftModel, dict]:
    """A loaded :class:`~jspec.target.Target` as a draft model for ``target_cfg``."""
    module = DraftModel(draft.config, target_cfg.vocab_size)
    module.validate(target_cfg)
    return module, {"net": dict(draft.params)}


def load(path, target, dtype=None) -> tuple[DraftModel, dict]:
    """``(module, params)`` of the Llama checkpoint at ``path`` (any format
    :func:`jspec.load_target` reads) as a draft model for ``target`` (a ``Target`` or a
    config; with a ``Target``, the tokenizers are compared too)."""
    from jspec.checkpoint import load_target
    cfg = getattr(target, "config", target)
    draft = load_target(path, dtype=dtype if dtype is not None else cfg.dtype)
    module, params = from_target(draft, cfg)         # the vocabulary sizes first
    check_tokenizers(target, draft)
    return module, params


def _build(target_cfg: LlamaConfig, key, num_layers: int = 2, **overrides):
    """Random weights: a ``num_layers`` model of the target's width (tests, benchmarks)."""
    module = DraftModel(target_cfg.replace(num_layers=num_layers, **overrides),
                        target_cfg.vocab_size)
    return module, module.init_params(key, target_cfg)


def _claims(d) -> bool:
    """A jspec Orbax target checkpoint (what ``jspec.convert`` and ``train.lm`` write)."""
    from jspec.checkpoint.orbax_io import CONFIG_FILE
    return (d / CONFIG_FILE).is_file()


ENTRY = register(DrafterKind(
    name="model", module=DraftModel, default_spec=SpecConfig(5, 4, 8), build=_build,
    modes={"chain": SpecConfig.chain(5), "default": SpecConfig(5, 4, 8),
           "wide": SpecConfig(6, 8, 32)},
    features="tokens", load=load, claims=_claims,
    from_arg=lambda path, target: load(path, target)))
