"""The layers floor: Flax NNX modules that own parameters and call ``linattn_jax.ops``.

One file per layer kind (``linear``, ``delta``, ``softmax``, ``mla``, ``mamba2``,
``mlstm``, ``lightning``, ``linearized``, ``gated_conv``, ``rwkv``, ``rglru``), the pieces
they share
(``conv``, ``gates``, ``feature_maps``, ``norms``, ``rope``, ``common``), the mixture of
experts (``moe``), the MLPs (``mlp``), hyper-connections' residual streams (``hyper``),
n-gram embeddings (``ngram``), the dispatch
between a decoding step, the sequence-parallel form and the full-sequence form written
once (``recurrent``), the blocks (``blocks``), and ONE registry of attention kinds
(``registry``).

Every layer takes ``*, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32`` like Flax's
own: parameters live in ``param_dtype``, computation runs in ``dtype`` (the input's when
None), and the recurrent states stay float32 whatever ``dtype`` is. Decoding states are
passed in and returned explicitly (``layer.init_state(batch)``, ``state=``,
``return_state=True``).
"""

from linattn_jax.layers import moe, norms, rope
from linattn_jax.layers.blocks import BlockState, TransformerBlock
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.delta import VARIANTS, DeltaRuleAttention, DeltaRuleCache
from linattn_jax.layers.feature_maps import (
    HEDGEHOG_FORMS,
    RANDOM_FEATURES,
    HedgehogFeatureMap,
    RandomProjection,
    T2RFeatureMap,
)
from linattn_jax.layers.gated_conv import GatedConvCache, GatedShortConv
from linattn_jax.layers.gates import ChannelGate, HeadGate, MambaGate
from linattn_jax.layers.hyper import HyperConnection
from linattn_jax.layers.indexed import IndexedAttention, IndexedCache
from linattn_jax.layers.lightning import LightningAttention, lightning_decays
from linattn_jax.layers.linear import GATES, LinearAttention, LinearAttentionCache
from linattn_jax.layers.linearized import LinearizedAttention, LinearizedCache
from linattn_jax.layers.mamba import MambaCache, MambaMixer
from linattn_jax.layers.mamba2 import GroupedGatedRMSNorm, Mamba2Cache, Mamba2Mixer
from linattn_jax.layers.mla import LatentAttention, LatentKVCache
from linattn_jax.layers.mlp import MLP, MLPS, GeGLU, ReLU2MLP, SwiGLU, mlp_layout
from linattn_jax.layers.mlstm import MLSTMLayer, MultiHeadLayerNorm
from linattn_jax.layers.moe import MoE
from linattn_jax.layers.ngram import NGramBlock, PerLayerNGrams, ngram_ids
from linattn_jax.layers.norms import GatedRMSNorm, RMSNorm
from linattn_jax.layers.recurrent import SequenceSharding, run_causal
from linattn_jax.layers.registry import ATTENTION_KINDS, KINDS, AttentionKind, make_attention
from linattn_jax.layers.rglru import RGLRUBlock, RGLRUCache
from linattn_jax.layers.rwkv import RWKVChannelMix, RWKVState, RWKVTimeMix, token_shift
from linattn_jax.layers.shared import SharedBlocks
from linattn_jax.layers.softmax import LINEAR_ONLY_OPTIONS, KVCache, SoftmaxAttention

__all__ = [
    "ATTENTION_KINDS",
    "GATES",
    "HEDGEHOG_FORMS",
    "KINDS",
    "LINEAR_ONLY_OPTIONS",
    "MLP",
    "MLPS",
    "MLSTMLayer",
    "RANDOM_FEATURES",
    "VARIANTS",
    "AttentionKind",
    "BlockState",
    "CausalConv1D",
    "ChannelGate",
    "DeltaRuleAttention",
    "DeltaRuleCache",
    "GatedRMSNorm",
    "GroupedGatedRMSNorm",
    "HeadGate",
    "HedgehogFeatureMap",
    "KVCache",
    "LatentAttention",
    "LatentKVCache",
    "LightningAttention",
    "LinearAttention",
    "LinearAttentionCache",
    "LinearizedAttention",
    "LinearizedCache",
    "Mamba2Cache",
    "Mamba2Mixer",
    "MambaGate",
    "MambaCache",
    "MambaMixer",
    "MoE",
    "SharedBlocks",
    "MultiHeadLayerNorm",
    "RMSNorm",
    "RandomProjection",
    "GeGLU",
    "ReLU2MLP",
    "SequenceSharding",
    "SoftmaxAttention",
    "SwiGLU",
    "T2RFeatureMap",
    "TransformerBlock",
    "lightning_decays",
    "make_attention",
    "mlp_layout",
    "moe",
    "norms",
    "rope",
    "run_causal",
    "GatedConvCache",
    "GatedShortConv",
    "RWKVChannelMix",
    "RWKVState",
    "RWKVTimeMix",
    "token_shift",
    "RGLRUBlock",
    "RGLRUCache",
    "HyperConnection",
    "NGramBlock",
    "PerLayerNGrams",
    "ngram_ids",
    "IndexedAttention",
    "IndexedCache",
]
