"""Complete models to start from: a causal language model and a sequence classifier."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import TransformerBlock


def _blocks(depth: int, width: int, num_heads: int, **kwargs) -> nnx.List:
    """``depth`` independently initialised ``TransformerBlock``s."""
    return nnx.List([TransformerBlock(width, num_heads, **kwargs) for _ in range(depth)])


class LanguageModel(nnx.Module):
    """Token embedding, causal blocks, final RMSNorm and a tied or untied output.

    Args:
      vocab_size: number of tokens.
      width, depth, num_heads: model width, number of blocks, heads per block.
      attention: ``"linear"`` or ``"softmax"``.
      tie_embeddings: share the embedding with the output projection.
      short_conv: kernel of a causal depthwise convolution before each attention (0: none).
      **block_kwargs: passed to every ``TransformerBlock`` (``feature_map``, ...).
    """

    def __init__(
        self,
        vocab_size: int,
        width: int,
        depth: int,
        num_heads: int,
        *,
        attention: str = "linear",
        tie_embeddings: bool = True,
        mlp_ratio: int = 4,
        short_conv: int = 0,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **block_kwargs,
    ):
        self.vocab_size = vocab_size
        self.embed = nnx.Embed(vocab_size, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = _blocks(
            depth,
            width,
            num_heads,
            attention=attention,
            causal=True,
            mlp_ratio=mlp_ratio,
            short_conv=short_conv,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            **block_kwargs,
        )
        self.norm = nnx.RMSNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.data(
            None
            if tie_embeddings
            else nnx.Linear(
                width, vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
        )

    def init_state(self, batch: int, max_length: int | None = None) -> list:
        """One decoding state per block (``max_length``: softmax's KV cache length)."""
        return [block.init_state(batch, max_length) for block in self.blocks]

    def __call__(
        self,
        tokens: jax.Array,
        *,
        segment_ids=None,
        key_mask=None,
        state=None,
        return_state: bool = False,
    ):
        """``tokens [b, t] int -> logits [b, t, vocab]`` (and the new states).

        ``key_mask [b, t]`` (True = real): masked tokens add nothing to any layer's
        state, cache or convolution window (left-padded prompts).

        Raises:
          ValueError: ``tokens`` not int ``[b, t]``, or (when concrete, not traced)
            holding ids outside ``[0, vocab_size)``.
        """
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be int [batch, length], got {tokens.dtype} {tokens.shape}"
            )
        _check_ids(tokens, self.vocab_size, "tokens")
        x = self.embed(tokens)
        states = [None] * len(self.blocks) if state is None else state
        new_states = []
        for block, s in zip(self.blocks, states, strict=True):
            x = block(
                x, segment_ids=segment_ids, key_mask=key_mask, state=s, return_state=return_state
            )
            if return_state:
                x, s = x
                new_states.append(s)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        logits = logits.astype(jnp.float32)
        return (logits, new_states) if return_state else logits

    def generate(
        self,
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
        """Samples up to ``steps`` tokens after ``prompt``, compiled end to end.

        One jitted call prefills the prompt (chunked form) and runs every decoding
        step in a ``lax.while_loop`` (one O(1) step of each linear-attention layer
        per token; softmax layers read a KV cache sized ``t + steps``), so a call
        costs one dispatch. Calls with the same shapes and the same static options
        (``steps``, greedy or not, ``top_k``, whether ``top_p`` / ``eos_id`` /
        ``prompt_mask`` are given, the model's structure) reuse the compiled program.

        Args:
          prompt: int ``[b, t]``, ``t >= 1``, ids in ``[0, vocab_size)``. Rows of
            different lengths are left-padded (any valid id as padding) and marked
            by ``prompt_mask``.
          steps: the most new tokens per row (``>= 0``).
          rng: a PRNG key, needed unless ``temperature == 0``; step ``i`` draws with
            ``fold_in(rng, i)``.
          temperature: ``> 0`` divides the logits before sampling; ``0`` is greedy.
          top_k: sample among the ``top_k`` most likely tokens only (``>= 1``).
          top_p: nucleus sampling: among the fewest most likely tokens whose
            probability (after ``temperature`` and ``top_k``) reaches ``top_p``, in (0, 1].
          eos_id: a row stops after sampling this id; its later tokens are ``pad_id``.
            The loop ends early once every row has stopped.
          pad_id: written after a row's ``eos_id`` (default: ``eos_id`` itself); any int.
          prompt_mask: bool ``[b, t]``, True for real tokens; left padding only (each
            row's last token real). Padded tokens reach nothing: each row's tokens
            equal those of generating that row alone.

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
        _check_ids(prompt, self.vocab_size, "prompt")
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
        if eos_id is not None and not 0 <= eos_id < self.vocab_size:
            raise ValueError(f"eos_id must be None or in [0, {self.vocab_size}), got {eos_id}")
        pad_id = None if pad_id is None else _int_arg("pad_id", pad_id)
        if prompt_mask is not None:
            _check_prompt_mask(prompt_mask, (b, t))
        if steps == 0:
            return prompt.astype(jnp.int32)
        greedy = temperature == 0
        if not greedy and rng is None:
            raise ValueError("sampling (temperature > 0) needs a PRNG key: pass rng")
        graphdef, variables = nnx.split(self)
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
            top_k=None if greedy or top_k is None or top_k >= self.vocab_size else top_k,
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


def _pad(pad_id: int | None, eos_id: int | None) -> int:
    if pad_id is not None:
        return pad_id
    return 0 if eos_id is None else eos_id


def _check_ids(tokens: jax.Array, vocab_size: int, name: str) -> None:
    """Token ids outside ``[0, vocab_size)`` raise, where ``tokens`` is concrete."""
    if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
        return
    lo, hi = int(jnp.min(tokens)), int(jnp.max(tokens))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"{name}: token ids must lie in [0, {vocab_size}), got values from {lo} to {hi}"
        )


def _check_prompt_mask(mask: jax.Array, shape: tuple[int, int]) -> None:
    if not hasattr(mask, "shape") or tuple(mask.shape) != shape or mask.dtype != jnp.bool_:
        raise ValueError(
            f"prompt_mask must be bool [batch, length]={shape} like prompt, got {_describe(mask)}"
        )
    if not isinstance(mask, jax.core.Tracer) and not bool(jnp.all(mask[:, -1])):
        raise ValueError(
            "prompt_mask must mark left padding: every row's last token must be real (True)"
        )


_GENERATE_TRACES = 0  # how many times _generate was traced (tests check no retracing)


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
    global _GENERATE_TRACES
    _GENERATE_TRACES += 1
    model = nnx.merge(graphdef, variables)
    b, t = prompt.shape
    logits, state = model(
        prompt, key_mask=prompt_mask, state=model.init_state(b, t + steps), return_state=True
    )

    def sample(logits, i):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        key = jax.random.fold_in(rng, i)
        return _sample(logits, key, temperature, top_p, top_k=top_k, use_top_p=use_top_p)

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
    model: LanguageModel,
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


def _sample(
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


class SequenceClassifier(nnx.Module):
    """A non-causal encoder, masked mean pooling and a linear classifier.

    Args:
      vocab_size, width, depth, num_heads: as in ``LanguageModel``.
      num_classes: output classes.
      attention: ``"linear"`` or ``"softmax"``.
      **block_kwargs: passed to every ``TransformerBlock``.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        width: int,
        depth: int,
        num_heads: int,
        *,
        attention: str = "linear",
        mlp_ratio: int = 4,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **block_kwargs,
    ):
        self.embed = nnx.Embed(vocab_size, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = _blocks(
            depth,
            width,
            num_heads,
            attention=attention,
            causal=False,
            mlp_ratio=mlp_ratio,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            **block_kwargs,
        )
        self.norm = nnx.RMSNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(width, num_classes, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, key_mask: jax.Array | None = None) -> jax.Array:
        """``tokens [b, t] int`` (``key_mask [b, t]``, True = real) ``-> logits [b, classes]``."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be int [batch, length], got {tokens.dtype} {tokens.shape}"
            )
        mask = jnp.ones(tokens.shape, bool) if key_mask is None else key_mask
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, key_mask=mask)
        x = self.norm(x)
        weights = mask.astype(x.dtype)[..., None]
        pooled = jnp.sum(x * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        return self.head(pooled).astype(jnp.float32)
