"""Called eagerly (outside ``jit``), the mLSTM's, RG-LRU's, RWKV's, the selective scan's and
SSD's ``causal`` compile one XLA program each, and the layers' pure steps one each: their
checks run on the host, the rest is one jitted function (inlined into a caller's program
under ``jit``). Run op by op, the mLSTM compiled about fifty programs and the MoE layer a
hundred, each call of an eager ``lax.scan`` again (a fresh body each time): seconds per
eager call. The additive form's and the delta rule's reference scans and the packed
non-causal form compile nothing at a second call (they compiled their loops at each).

Each case has shapes of its own (b=3, t=37), so no program is in JAX's caches before it;
the count is of lowerings (``jax_log_compiles``: a program read back from the persistent
cache counts too)."""

import contextlib
import logging

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import linattn_jax as la
from linattn_jax.layers import conv, gates, moe, norms, rope, soft_cap
from linattn_jax.ops import checks

B, T, H, D = 3, 37, 2, 8


class _Names(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            name = message.split(" with ")[0].removeprefix("Compiling ")
            self.names.append(name.removeprefix("jit(").removesuffix(")"))


@contextlib.contextmanager
def compiled():
    """The names of the programs lowered inside the block."""
    handler = _Names()
    loggers = [logging.getLogger(n) for n in ("jax._src.interpreters.pxla", "jax._src.dispatch")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield handler.names
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in ks[:3])
    i, f = (jax.random.normal(key, (B, T, H)) for key in ks[3:5])
    x = q.reshape(B, T, H * D)
    logits = x.reshape(B * T, H * D)[:, :8]
    return dict(
        q=q, k=k, v=v, i=i, f=f, mask=jnp.arange(T)[None] >= jnp.arange(B)[:, None],
        dt=jax.nn.softplus(i), gate=-jax.nn.softplus(i), A=-jnp.arange(1.0, H + 1),
        B=q[:, :, :1], C=k[:, :, :1], x=x, dt3=jax.nn.softplus(k.reshape(B, T, H * D)),
        A3=-jnp.ones((H * D, 4)), B3=x[..., :4], C3=x[..., 4:8], a=jnp.ones((H, D)),
        segments=jnp.broadcast_to(jnp.arange(T) // 9, (B, T)), positions=jnp.ones((B, T), jnp.int32),
        logits=logits, probs=jax.nn.softmax(logits), experts=jnp.zeros((B * T, 2), jnp.int32),
    )  # fmt: skip


CASES = {
    "mlstm": lambda a: la.mlstm(a["q"], a["k"], a["v"], a["i"], a["f"], key_mask=a["mask"]),
    "mlstm scan": lambda a: la.mlstm(
        a["q"], a["k"], a["v"], a["i"], a["f"], method="scan", return_state=True
    ),
    "rglru": lambda a: la.rglru(a["q"], a["k"], a["v"], a_param=a["a"], segment_ids=a["segments"]),
    "wkv": lambda a: la.wkv(a["k"], a["v"], time_decay=a["a"], time_first=a["a"]),
    "wkv chunked": lambda a: la.wkv(
        a["k"], a["v"], time_decay=a["a"], time_first=a["a"], method="chunked"
    ),
    "selective scan": lambda a: la.selective_scan(a["x"], a["dt3"], a["A3"], a["B3"], a["C3"]),
    "ssd": lambda a: la.ssd(a["v"], a["dt"], a["A"], a["B"], a["C"], key_mask=a["mask"]),
    "log_decay": lambda a: checks.log_decay(0.9, a["gate"], B, T, H, jnp.float32),
    "dot_product_attention": lambda a: soft_cap.dot_product_attention(
        a["q"], a["k"], a["v"], is_causal=True, soft_cap=5.0
    ),
    "apply_rope": lambda a: rope.apply_rope(a["q"], a["positions"], 8, 1e4),
    "token_positions": lambda a: rope.token_positions(B, T, segment_ids=a["segments"]),
    "route": lambda a: moe.route(a["logits"], 2, score="sigmoid", normalize=True, num_groups=2),
    "load_balancing_loss": lambda a: moe.load_balancing_loss(a["probs"], a["experts"]),
    "router_z_loss": lambda a: moe.router_z_loss(a["logits"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_eager_call_is_one_program(name):
    arrays = _inputs()
    jax.block_until_ready(arrays)
    with compiled() as names:
        jax.block_until_ready(CASES[name](arrays))
    assert len(names) == 1, names


# The reference recurrences and the packed non-causal form: their feature maps and checks
# run op by op, their loops are one jitted function (which compiled again at every call).
AGAIN = {
    "causal scan": lambda a: la.causal_linear_attention(
        a["q"], a["k"], a["v"], gate=a["gate"], method="scan", return_state=True
    ),
    "delta rule scan": lambda a: la.delta_rule(
        a["q"], a["k"], a["v"], jax.nn.sigmoid(a["i"]), gate=a["gate"], method="scan"
    ),
    "delta rule scan, grouped": lambda a: la.delta_rule(
        a["q"][:, :, :1], a["k"][:, :, :1], a["v"], jax.nn.sigmoid(a["i"]), method="scan"
    ),
    "non-causal with segments": lambda a: la.linear_attention(
        a["q"], a["k"], a["v"], segment_ids=a["segments"]
    ),
}


@pytest.mark.parametrize("name", list(AGAIN))
def test_a_second_eager_call_compiles_nothing(name):
    arrays = _inputs()
    jax.block_until_ready(AGAIN[name](arrays))
    with compiled() as names:
        jax.block_until_ready(AGAIN[name](arrays))
    assert names == []


def test_the_layers_steps_and_inits_are_a_program_each():
    """The MoE layer's experts, the zero-centred and gated norms, the convolution's and the
    decay gate's initialisation: one program each, eagerly."""
    x = jax.random.normal(jax.random.PRNGKey(1), (B * T, 16))
    routing = moe.route(x[:, :4], 2)
    up, down = (jax.random.normal(jax.random.PRNGKey(n), s) for n, s in [(2, (4, 16, 6)),
                                                                        (3, (4, 6, 16))])  # fmt: skip
    norm = norms.GatedRMSNorm(16, zero_centred=True, rngs=nnx.Rngs(0))
    jax.block_until_ready((x, routing, up, down, norm.scale[...]))
    with compiled() as names:
        jax.block_until_ready(moe.combine_experts(x, routing, None, None, up, down))
    assert names == ["combine_experts"]
    with compiled() as names:
        jax.block_until_ready(norm(x, x))
    assert names == ["_rms_norm", "_gated"]
    with compiled() as names:
        conv.CausalConv1D(13, 5, rngs=nnx.Rngs(0))
        gates.MambaGate(16, 7, rngs=nnx.Rngs(0))
    assert [n for n in names if n.startswith("_init")] == ["_init_kernel", "_init_decays"]
