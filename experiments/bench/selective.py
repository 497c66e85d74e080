"""Mamba-1's selective scan (``linattn_jax.ops.selective``): its chunked form against its
per-token scan and against the additive family's per-channel-gated (GLA) form of the same
recurrence (every channel a head of value width one: ``q = C``, ``k = B``, ``v = dt x``,
log-decays ``dt A``), forward and forward+backward, one row per length::

    python -m experiments.bench.selective --lengths 2048,8192,16384 --channels 1536

Times are wall ms (``jax.block_until_ready``), the median of ``--repeats`` calls after a
warm-up call of the compiled program; ``error`` is each form's normwise distance to the
chunked form's output. A form that raises keeps its row, with the error.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import additive, selective


def inputs(b: int, t: int, d: int, n: int):
    """Random ``(x, dt, A, B, C)`` of the scan, float32."""
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    return (
        jax.random.normal(ks[0], (b, t, d)),
        jax.nn.softplus(jax.random.normal(ks[1], (b, t, d)) - 2.0),
        -jnp.exp(jax.random.normal(ks[2], (d, n))),
        jax.random.normal(ks[3], (b, t, n)),
        jax.random.normal(ks[4], (b, t, n)),
    )


def as_additive(x, dt, A, B, C):
    """The same recurrence through ``ops.additive.causal``: ``[b, t, d]``."""
    heads = lambda y: jnp.broadcast_to(y[:, :, None], (*x.shape, y.shape[-1]))
    gate = dt[..., None] * A[None, None]
    out = additive.causal(
        heads(C), heads(B), (dt * x)[..., None], gate=gate, feature_map="identity",
        normalize=False,
    )  # fmt: skip
    return out[..., 0]


FORMS = {
    "chunked": functools.partial(selective.causal, method="chunked"),
    "scan": functools.partial(selective.causal, method="scan"),
    "additive": as_additive,
}


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def run(lengths, b: int, d: int, n: int, repeats: int) -> list[str]:
    """The markdown table's rows."""
    rows = ["| t | form | forward ms | forward+backward ms | error |", "|---|---|---|---|---|"]
    for t in lengths:
        args = inputs(b, t, d, n)
        reference = None
        for name, form in FORMS.items():
            try:
                forward = jax.jit(form)
                loss = lambda *a, form=form: jnp.sum(form(*a) ** 2)
                backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
                out = np.asarray(forward(*args), np.float64)
                reference = out if reference is None else reference
                error = np.linalg.norm(out - reference) / np.linalg.norm(reference)
                times = median_ms(forward, args, repeats), median_ms(backward, args, repeats)
                rows.append(f"| {t} | {name} | {times[0]:.1f} | {times[1]:.1f} | {error:.1e} |")
            except Exception as e:  # noqa: BLE001 (a form's failure is its row)
                rows.append(f"| {t} | {name} | - | - | {type(e).__name__}: {str(e)[:80]} |")
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels", type=int, default=1536, help="d_inner (Mamba-130m's)")
    parser.add_argument("--state", type=int, default=16, help="n, the state per channel")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"devices: {jax.devices()}; b={args.batch} d={args.channels} n={args.state}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    run(lengths, args.batch, args.channels, args.state, args.repeats)


if __name__ == "__main__":
    main()
