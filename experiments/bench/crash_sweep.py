"""Whether compiling and running GLA forward+backward can crash XLA (issue 40, item 3).

Each case compiles ``jax.grad`` of ``sum(out * c)`` with respect to q, k, v and the
per-channel log-gates g of ``causal_linear_attention(q, k, v, gate=g, chunk_size=C)``
(``jax.jit(...).lower(...).compile()``), runs it once and waits for it
(``block_until_ready``), in a subprocess of its own, so that a crash (a signal) ends one
case, not the sweep. The group size (tokens whose chunks run at once) is set through
``chunking.GROUP_TOKENS_CPU`` in the subprocess. One line per case, then a summary; the exit
status is 1 when any case crashed, failed or timed out::

    python -m experiments.bench.crash_sweep            # a covering subset (14 cases)
    python -m experiments.bench.crash_sweep --full     # the whole product (384 cases)
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys

CASE = """
import sys
import jax, jax.numpy as jnp
import linattn_jax as la
from linattn_jax.ops import chunking
t, h, d, chunk, group, dtype = sys.argv[1:]
t, h, d, chunk, group = map(int, (t, h, d, chunk, group))
chunking.GROUP_TOKENS_CPU = group
dtype = jnp.dtype(dtype)
ks = jax.random.split(jax.random.PRNGKey(0), 5)
q, k, v, c = (jax.random.normal(kk, (1, t, h, d), dtype) for kk in ks[:4])
g = -jax.nn.softplus(jax.random.normal(ks[4], (1, t, h, d))).astype(dtype)
def loss(q, k, v, g):
    out = la.causal_linear_attention(q, k, v, gate=g, chunk_size=chunk)
    return jnp.sum(out.astype(jnp.float32) * c.astype(jnp.float32))
grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, g).compile()(q, k, v, g)
jax.block_until_ready(grads)
assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in grads), "non-finite"
print("ok")
"""

FULL = dict(
    t=(1, 63, 64, 1000, 1024, 4096),
    h=(1, 8),
    d=(16, 64),
    chunk=(16, 64, 128, 256),
    group=(1, 512),
    dtype=("float32", "bfloat16"),
)


SUBSET = [  # a covering set: every value of each axis, the cases first
    (1024, 8, 64, 64, 1, "float32"),
    (1024, 8, 64, 64, 1, "bfloat16"),
    (1024, 8, 64, 64, 512, "float32"),
    (1024, 8, 64, 64, 512, "bfloat16"),
    (64, 8, 64, 64, 1, "float32"),
    (1, 1, 16, 16, 1, "float32"),
    (63, 1, 16, 16, 512, "bfloat16"),
    (1000, 8, 16, 128, 1, "bfloat16"),
    (1000, 1, 64, 256, 512, "float32"),
    (4096, 8, 64, 64, 1, "float32"),
    (4096, 8, 64, 256, 512, "bfloat16"),
    (4096, 1, 16, 16, 512, "float32"),
    (1024, 1, 64, 128, 512, "bfloat16"),
    (64, 8, 16, 256, 1, "bfloat16"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole product")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    args = parser.parse_args(argv)
    cases = list(itertools.product(*FULL.values())) if args.full else SUBSET
    bad = 0
    for case in cases:
        label = "t={} h={} d={} chunk={} group={} {}".format(*case)
        try:
            out = subprocess.run(
                [sys.executable, "-c", CASE, *map(str, case)],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
            if out.returncode < 0:
                status = f"CRASHED (signal {-out.returncode})"
        except subprocess.TimeoutExpired:
            status, out = "TIMED OUT", None
        bad += status != "ok"
        print(f"{label}: {status}", flush=True)
        if status != "ok" and out is not None and out.stderr.strip():
            print("  " + out.stderr.strip().splitlines()[-1], flush=True)
    print(f"crash_sweep: {len(cases) - bad} of {len(cases)} cases ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
