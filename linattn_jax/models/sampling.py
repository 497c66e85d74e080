"""Sampling from a language model: ``generate`` (prefill, then a compiled decoding loop),
the loop itself (``decode_loop``) and one draw (``sample_logits``)."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax.ops.checks import concrete_range, describe, is_concrete

GREEDY_BELOW = 1e-6  # temperatures below it sample greedily: logits / T would overflow
INT32 = (-(2**31), 2**31 - 1)  # the range of the token ids generate writes (int32)


def generate(
    model,
    prompt: jax.Array,
    steps: int,
    rng: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    prompt_mask: jax.Array | None = None,
) -> jax.Array:
    """``model.generate(prompt, steps, rng, ...)``: samples up to ``steps`` tokens after
    ``prompt``, compiled end to end.

    One jitted call prefills the prompt (chunked form) and runs every decoding
    step in a ``lax.while_loop`` (one O(1) step of each linear-attention layer
    per token; softmax layers read a KV cache sized ``t + steps``), so a call
    costs one dispatch. Calls with the same shapes and the same static options
    (``steps``, greedy or not, ``top_k``, whether ``top_p`` / ``eos_id`` /
    ``prompt_mask`` are given, the model's structure) reuse the compiled program.

    Args:
      model: a ``LanguageModel`` (anything with its ``vocab_size``, ``init_state`` and
        call).
      prompt: int ``[b, t]``, ``t >= 1``, ids in ``[0, vocab_size)``. Rows of
        different lengths are left-padded (any valid id as padding) and marked
        by ``prompt_mask``.
      steps: the most new tokens per row (``>= 0``).
      rng: a PRNG key, needed unless sampling is greedy; step ``i`` draws with
        ``fold_in(rng, i)``.
      temperature: ``> 0`` divides the logits before sampling; ``0`` (or anything
        below ``sampling.GREEDY_BELOW``, 1e-6, where the division would overflow) is
        greedy.
      top_k: sample among the ``top_k`` most likely tokens only (``>= 1``).
      top_p: nucleus sampling: among the fewest most likely tokens whose
        probability (after ``temperature`` and ``top_k``) reaches ``top_p``, in (0, 1].
      eos_id: a row stops after sampling this id; its later tokens are ``pad_id``.
        The loop ends early once every row has stopped.
      pad_id: written after a row's ``eos_id`` (default: ``eos_id`` itself); any int.
      prompt_mask: bool ``[b, t]``, True for real tokens; left padding only (each
        row: padding, then real tokens to its end; a hole raises). Padded tokens
        reach nothing: each row's tokens equal those of generating that row alone.

    Returns:
      int32 ``[b, t + steps]``: the prompt, then the new tokens.

    Raises:
      ValueError: an empty prompt (``t == 0``: there is no logit to sample the
        first token from), ids outside ``[0, vocab_size)`` or a badly shaped
        prompt or mask, ``steps < 0``, ``temperature`` < 0, NaN or inf, ``top_k < 1``,
        ``top_p`` outside (0, 1], ``eos_id`` outside the vocabulary, or no
        ``rng`` for sampling.
    """
    if not hasattr(prompt, "ndim") or prompt.ndim != 2:
        raise ValueError(f"prompt must be int [batch, length], got {_describe(prompt)}")
    if not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be int [batch, length], got {_describe(prompt)}")
    b, t = prompt.shape
    if t == 0:
        raise ValueError(
            f"generate needs a non-empty prompt (no logit to sample from), got shape {(b, t)}"
        )
    check_ids(prompt, model.vocab_size, "prompt")
    steps = _int_arg("steps", steps)
    if steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps}")
    temperature = _float_arg("temperature", temperature)
    if not 0 <= temperature < math.inf:  # NaN too
        raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {temperature}")
    top_k = None if top_k is None else _int_arg("top_k", top_k)
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k}")
    if top_p is not None:
        top_p = _float_arg("top_p", top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {top_p}")
    eos_id = None if eos_id is None else _int_arg("eos_id", eos_id)
    if eos_id is not None and not 0 <= eos_id < model.vocab_size:
        raise ValueError(f"eos_id must be None or in [0, {model.vocab_size}), got {eos_id}")
    pad_id = None if pad_id is None else _int_arg("pad_id", pad_id)
    if pad_id is not None and not INT32[0] <= pad_id <= INT32[1]:
        raise ValueError(f"pad_id must be an int in [{INT32[0]}, {INT32[1]}] (int32), got {pad_id}")
    if rng is not None:
        check_rng(rng)
    if prompt_mask is not None:
        _check_prompt_mask(prompt_mask, (b, t))
    if steps == 0:
        return prompt.astype(jnp.int32)
    greedy = temperature < GREEDY_BELOW
    if not greedy and rng is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: pass rng")
    graphdef, variables = nnx.split(model)
    return _generate(
        graphdef,
        variables,
        prompt.astype(jnp.int32),
        prompt_mask,
        jax.random.PRNGKey(0) if rng is None else rng,
        jnp.float32(1.0 if greedy else temperature),
        jnp.float32(1.0 if top_p is None else top_p),
        jnp.int32(-1 if eos_id is None else eos_id),
        jnp.int32(_pad(pad_id, eos_id)),
        steps=steps,
        greedy=greedy,
        top_k=None if greedy or top_k is None or top_k >= model.vocab_size else top_k,
        use_top_p=not greedy and top_p is not None and top_p < 1,
        use_eos=eos_id is not None,
    )


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__


def _int_arg(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError as error:
        raise ValueError(f"{name} must be an int, got {value!r}") from error


def _float_arg(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a number, got {value!r}") from error


def check_rng(rng) -> None:
    """A PRNG key: a typed key (``jax.random.key``) or a raw uint32 one
    (``jax.random.PRNGKey``), one key, not a batch of them; or a ValueError."""
    typed = isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    raw = isinstance(rng, jax.Array) and rng.dtype == jnp.uint32 and rng.ndim == 1
    if not ((typed and rng.ndim == 0) or raw):
        raise ValueError(
            "rng must be a PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), got "
            f"{describe(rng)}"
        )


def _pad(pad_id: int | None, eos_id: int | None) -> int:
    if pad_id is not None:
        return pad_id
    return 0 if eos_id is None else eos_id


def check_ids(tokens: jax.Array, vocab_size: int, name: str) -> None:
    """Token ids outside ``[0, vocab_size)`` raise, where ``tokens`` is concrete."""
    span = concrete_range(tokens)  # eager even while a jit traces a closure over tokens
    if span is None:
        return
    lo, hi = span
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"{name}: token ids must lie in [0, {vocab_size}), got values from {lo} to {hi}"
        )


def _check_prompt_mask(mask: jax.Array, shape: tuple[int, int]) -> None:
    if not hasattr(mask, "shape") or tuple(mask.shape) != shape or mask.dtype != jnp.bool_:
        raise ValueError(
            f"prompt_mask must be bool [batch, length]={shape} like prompt, got {_describe(mask)}"
        )
    if not is_concrete(mask):
        return
    mask = np.asarray(mask)  # numpy: jnp would be staged under a jit that closes over it
    # Left padding: each row False... then True... (a hole would shift the later tokens).
    rows = np.any(mask[:, 1:] < mask[:, :-1], axis=1) | ~mask[:, -1]
    if np.any(rows):
        raise ValueError(
            "prompt_mask must mark left padding only (each row: padding, then real tokens "
            f"to its end), got a mask that does not in rows {np.nonzero(rows)[0].tolist()}"
        )


_TRACES = 0  # how many times _generate was traced


def trace_count() -> int:
    """How many times ``generate``'s compiled body has been traced in this process (a call
    with the shapes and static options of an earlier one adds none)."""
    return _TRACES


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "steps", "greedy", "top_k", "use_top_p", "use_eos"),
)
def _generate(
    graphdef,
    variables,
    prompt,
    prompt_mask,
    rng,
    temperature,
    top_p,
    eos_id,
    pad_id,
    *,
    steps: int,
    greedy: bool,
    top_k: int | None,
    use_top_p: bool,
    use_eos: bool,
):
    """The compiled body of ``LanguageModel.generate``: prefill, then a decoding loop."""
    global _TRACES
    _TRACES += 1
    model = nnx.merge(graphdef, variables)
    b, t = prompt.shape
    logits, state = model(
        prompt, key_mask=prompt_mask, state=model.init_state(b, t + steps), return_state=True
    )

    def sample(logits, i):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        key = jax.random.fold_in(rng, i)
        return sample_logits(logits, key, temperature, top_p, top_k=top_k, use_top_p=use_top_p)

    out = decode_loop(
        model,
        logits[:, -1],
        state,
        steps=steps,
        sample=sample,
        eos_id=eos_id if use_eos else None,
        pad_id=pad_id,
    )
    return jnp.concatenate([prompt, out], axis=1)


def decode_loop(
    model,
    logits: jax.Array,
    state: list,
    *,
    steps: int,
    sample: Callable[[jax.Array, jax.Array], jax.Array],
    eos_id: jax.Array | None = None,
    pad_id: jax.Array | int = 0,
) -> jax.Array:
    """``steps`` new tokens ``[b, steps]`` int32 from the last logits ``[b, vocab]`` and
    the decoding ``state`` after them: one model step per token after the first, in
    a ``lax.while_loop`` that ends once every row has sampled ``eos_id`` (if given).

    ``sample(logits [b, vocab], i) -> [b]`` int32 draws token ``i``.
    """
    b = logits.shape[0]
    token = sample(logits, 0)
    done = jnp.zeros((b,), bool) if eos_id is None else token == eos_id
    out = jnp.full((b, steps), pad_id, jnp.int32).at[:, 0].set(token)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < steps) & ~jnp.all(done)

    def body(carry):
        i, token, state, out, done = carry
        logits, state = model(token[:, None], state=state, return_state=True)
        token = sample(logits[:, 0], i)
        written = jnp.where(done, pad_id, token)  # a stopped row gets padding
        out = jax.lax.dynamic_update_slice_in_dim(out, written[:, None], i, axis=1)
        if eos_id is not None:
            done = done | (token == eos_id)
        return i + 1, token, state, out, done

    return jax.lax.while_loop(cond, body, (jnp.int32(1), token, state, out, done))[3]


def sample_logits(
    logits: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    top_k: int | None,
    use_top_p: bool,
) -> jax.Array:
    """Draws one token per row from ``logits [b, vocab]`` (``top_k`` then ``top_p``)."""
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if use_top_p:
        ranked = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        # Keep a token while the mass of those ranked above it is below top_p (the first always).
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p
        cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
