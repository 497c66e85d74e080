"""Ours against other JAX implementations of the same maths, on the same inputs (b=1, h=8,
d=dv=64, float32), forward and forward+backward, interleaved repetitions in one process:

* ``performer``: the additive form against a Performer-style baseline written here (no
  peer code in this repository), with ``--feature-map`` features on both sides (elu + 1;
  or relu, Performer's own ``relu(x) + 0.001`` on its side): non-causal, the two einsums
  on ``[b, t, h, d]``; causal, a per-token prefix sum in ``lax.scan`` with the custom
  gradient of Performer's JAX code (the backward rebuilds the earlier states by
  subtracting outer products from the final one); ``--heads`` heads.
* ``--impl module:function``: any JAX function installed separately (e.g. a thin adapter
  over jax-linear-attention's ``jla.ops.linear_attention(kind, ..., impl="chunked")``),
  called with the arguments of ``recurrences.recurrence_case`` for ``--families``:
  ``(q, k, v, gate)`` for the additive families, ``(q, k, v, beta, gate)`` for the delta
  rule (``gate`` None for DeltaNet; ``[b, t, h]`` per head, ``[b, t, h, d]`` per channel),
  ``(q, k, v, i, f)`` for the mLSTM (gate pre-activations ``[b, t, h]``: input gate
  ``exp(i)``, forget gate ``sigmoid(f)``, queries scaled by ``d ** -0.5``, as NX-AI's
  mlstm-kernels) and returning ``out [b, t, h, dv]``. Ours runs the same maths: the delta rule with
  scale 1; the additive families with identity features and no denominator
  (``simple_gla`` is ``additive_decay`` so computed). ``--families causal`` or
  ``noncausal`` call it as ``(q, k, v)`` ``[b, t, h, d]`` at ``--heads`` heads, ours the
  additive form with ``--feature-map`` features, normalised (Performer's own
  ``fast_attention.py`` through an adapter: ``make_fast_generalized_attention`` with
  deterministic relu features); ``state_products_cC`` and ``all_products_cC`` time in
  ours' place the bare matmuls of a chunked form with chunks of C (``chunk_products``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp

import linattn_jax as la
from experiments.bench.recurrences import recurrence_case
from experiments.bench.timing import scratch_mib, time_ms, write_table


def _elu1(x):
    return jax.nn.elu(x) + 1.0


def _relu(x):  # Performer's relu kernel with its numerical stabiliser
    return jax.nn.relu(x) + 0.001


FEATURES = {"elu": _elu1, "relu": _relu}


def performer_noncausal(q, k, v, phi=_elu1):
    """Performer-style non-causal linear attention: two einsums, ``[b, t, h, d]``."""
    q, k = phi(q), phi(k)
    kv = jnp.einsum("bthd,bthv->bhdv", k, v)
    num = jnp.einsum("bthd,bhdv->bthv", q, kv)
    den = jnp.einsum("bthd,bhd->bth", q, jnp.sum(k, axis=1))
    return num / (den[..., None] + 1e-6)


@jax.custom_vjp
def _prefix_num(q, k, v):
    """``out_i = q_i^T sum_{j <= i} k_j v_j^T``, one scan step per token, ``[t, b, h, .]``."""
    return _prefix_num_fwd(q, k, v)[0]


def _prefix_num_fwd(q, k, v):
    def step(s, x):
        qi, ki, vi = x
        s = s + jnp.einsum("bhd,bhv->bhdv", ki, vi)
        return s, jnp.einsum("bhd,bhdv->bhv", qi, s)

    s0 = jnp.zeros(q.shape[1:] + v.shape[-1:], q.dtype)
    s, out = jax.lax.scan(step, s0, (q, k, v))
    return out, (q, k, v, s)


def _prefix_num_bwd(residuals, d_out):
    q, k, v, s = residuals

    def step(carry, x):  # from the last token: the state before it by subtraction
        s, d_s = carry
        qi, ki, vi, di = x
        d_q = jnp.einsum("bhv,bhdv->bhd", di, s)
        d_s = d_s + jnp.einsum("bhd,bhv->bhdv", qi, di)
        d_k, d_v = jnp.einsum("bhdv,bhv->bhd", d_s, vi), jnp.einsum("bhdv,bhd->bhv", d_s, ki)
        s = s - jnp.einsum("bhd,bhv->bhdv", ki, vi)
        return (s, d_s), (d_q, d_k, d_v)

    _, grads = jax.lax.scan(step, (s, jnp.zeros_like(s)), (q, k, v, d_out), reverse=True)
    return grads


_prefix_num.defvjp(_prefix_num_fwd, _prefix_num_bwd)


def performer_causal(q, k, v, phi=_elu1):
    """Performer-style causal linear attention (elu + 1 features)."""
    seq = functools.partial(jnp.moveaxis, source=1, destination=0)
    q, k = seq(phi(q)), seq(phi(k))
    num = _prefix_num(q, k, seq(v))
    den = jnp.einsum("tbhd,tbhd->tbh", q, jnp.cumsum(k, axis=0))
    return jnp.moveaxis(num / (den[..., None] + 1e-6), 0, 1)


def ours_additive(name: str):
    """The additive family's chunked form on a peer's maths: identity features, no
    denominator, the gate as given."""

    def fn(q, k, v, gate):
        return la.causal_linear_attention(
            q, k, v, gate=gate, feature_map="identity", normalize=False
        )

    return fn


def load(spec: str):
    """``module:function`` -> the function."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--impl must be module:function, got {spec!r}")
    return getattr(importlib.import_module(module), name)


# The forms ``--families`` names for a peer called as ``(q, k, v)`` (Performer's).
ATTENTION_FORMS = {"noncausal": la.linear_attention, "causal": la.causal_linear_attention}


def chunk_products(q, k, v, *, chunk: int, in_chunk: bool):
    """The bare matmuls of a chunked causal form on ``[b, t, h, d]`` buffers: each chunk's
    write ``K^T V`` and read ``Q (K^T V)``, batched over all chunks at once (Performer's
    scan's FLOPs); with ``in_chunk`` also the in-chunk ``(Q K^T) V``. No scan, mask,
    decay, feature map, normaliser or transpose (the buffers are read as heads-first
    ``[b, h, t / chunk, chunk, d]``, the batched products' fastest layout): not attention,
    a bound on the time of any chunked form (``t`` a multiple of ``chunk``)."""
    b, t, h, d = q.shape
    split = lambda x: x.reshape(b, h, t // chunk, chunk, x.shape[-1])
    q, k, v = split(q), split(k), split(v)
    out = jnp.einsum("bhncd,bhnde->bhnce", q, jnp.einsum("bhncd,bhnce->bhnde", k, v))
    if in_chunk:
        scores = jnp.einsum("bhnid,bhnjd->bhnij", q, k)
        out = out + jnp.einsum("bhnij,bhnje->bhnie", scores, v)
    return out.reshape(b, t, h, -1)


# ``--families`` names for that bound in place of ours: ``state_products_c64``,
# ``all_products_c32`` (the in-chunk products too), ... (the chunk after ``_c``).
PRODUCTS = {"state_products": False, "all_products": True}


def attention_inputs(t: int, heads: int):
    """``(q, k, v)``, each ``[1, t, heads, 64]`` float32."""
    keys = jax.random.split(jax.random.PRNGKey(t), 3)
    return tuple(jax.random.normal(key, (1, t, heads, 64)) for key in keys)


def cases(t: int, families, impl: str | None, feature_map: str = "elu", heads: int = 8):
    """``(family, ours, theirs, args)`` per case at length ``t``."""
    if impl is None:
        q, k, v = attention_inputs(t, heads)
        phi = FEATURES[feature_map]
        ours = functools.partial(la.linear_attention, feature_map=feature_map)
        yield "noncausal", ours, functools.partial(performer_noncausal, phi=phi), (q, k, v)
        ours = functools.partial(la.causal_linear_attention, feature_map=feature_map)
        yield "causal", ours, functools.partial(performer_causal, phi=phi), (q, k, v)
        return
    theirs = load(impl)
    for family in families:
        kind, _, chunk = family.rpartition("_c")
        if kind in PRODUCTS:
            ours = functools.partial(chunk_products, chunk=int(chunk), in_chunk=PRODUCTS[kind])
            yield family, ours, theirs, attention_inputs(t, heads)
            continue
        if family in ATTENTION_FORMS:
            ours = functools.partial(ATTENTION_FORMS[family], feature_map=feature_map)
            yield family, ours, theirs, attention_inputs(t, heads)
            continue
        ours, args = recurrence_case(family, "chunked", t)
        if len(args) == 4:  # additive: the peer's maths (identity features, no denominator)
            ours = ours_additive(family)
        yield family, ours, theirs, args


def measure(
    lengths, repeats: int, families, impl: str | None, feature_map: str = "elu", heads: int = 8
) -> list[dict]:
    rows = []
    for t in lengths:
        for family, ours, theirs, args in cases(t, families, impl, feature_map, heads):
            argnums = tuple(i for i, a in enumerate(args) if a is not None)
            peer = impl or f"performer (inline, {feature_map}, h={heads})"
            row = dict(t=t, family=family, peer=peer)
            timings = {}
            for _ in range(2):  # interleaved: ours, theirs, ours, theirs
                for who, fn in (("ours", ours), ("peer", theirs)):
                    grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a)), argnums=argnums)
                    fwd = time_ms(jax.jit(fn), args, repeats)[1]
                    both = time_ms(jax.jit(grad), args, repeats)[1]
                    old = timings.get(who, (fwd, both))
                    timings[who] = (min(old[0], fwd), min(old[1], both))
            for who, fn in (("ours", ours), ("peer", theirs)):
                grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a)), argnums=argnums)
                row[f"{who}_fwd_cpu_ms"], row[f"{who}_fwd_bwd_cpu_ms"] = timings[who]
                row[f"{who}_fwd_bwd_scratch_mib"] = scratch_mib(grad, args)
            row["fwd_speedup"] = row["peer_fwd_cpu_ms"] / row["ours_fwd_cpu_ms"]
            row["fwd_bwd_speedup"] = row["peer_fwd_bwd_cpu_ms"] / row["ours_fwd_bwd_cpu_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| t | form | peer | fwd CPU ms ours / peer | speed-up | fwd+bwd CPU ms ours / peer "
        "| speed-up | fwd+bwd scratch MiB ours / peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['t']} | {r['family']} | {r['peer']} | {r['ours_fwd_cpu_ms']:.1f} / "
            f"{r['peer_fwd_cpu_ms']:.1f} | {r['fwd_speedup']:.2f}x | "
            f"{r['ours_fwd_bwd_cpu_ms']:.1f} / {r['peer_fwd_bwd_cpu_ms']:.1f} | "
            f"{r['fwd_bwd_speedup']:.2f}x | {r['ours_fwd_bwd_scratch_mib']:.1f} / "
            f"{r['peer_fwd_bwd_scratch_mib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> None:
    """Measures at ``args.lengths``, writes ``peers.md`` to ``args.out``, prints it."""
    lengths = [int(x) for x in args.lengths.split(",") if x]
    families = args.families.split(",") if args.families else ["gated_deltanet"]
    text = table(measure(lengths, args.repeats, families, args.impl, args.feature_map, args.heads))
    print(write_table(Path(args.out), "peers.md", text, command))
