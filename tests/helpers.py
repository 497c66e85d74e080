"""Shared test inputs and the one table of tolerances per dtype."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import linattn_jax as la

# Forward outputs, compared with the float32 reference on the same (rounded) inputs.
# float32: sums are reordered (chunks, scans), so a few ulps of the largest term.
# bfloat16: the output is rounded to 8 bits of mantissa (relative 2^-8 = 4e-3).
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=1e-2, rtol=1e-2),
}
# Gradients accumulate over the sequence twice (forward and reverse), float32 only:
# compared normwise (``assert_close_normwise``), so the bound scales with the gradient's
# size and does not hinge on one element's rounding (which depends on the CPU's vector
# width).
GRAD_RTOL = 1e-5


def assert_close_normwise(actual, expected, rtol: float = GRAD_RTOL) -> None:
    """Each leaf's ``||actual - expected|| <= rtol * ||expected||`` (Frobenius norms; a zero
    ``expected`` needs an exact zero), with shapes equal."""
    jax.tree.map(lambda a, e: _check_normwise(a, e, rtol), actual, expected)


def _check_normwise(a, e, rtol: float) -> None:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, f"shapes differ: {a.shape} vs {e.shape}"
    error, size = np.linalg.norm(a - e), np.linalg.norm(e)
    assert np.isfinite(error) and error <= rtol * size, (
        f"normwise relative error {error / max(size, 1e-300):.3g} > {rtol:g} "
        f"(|error| {error:.3g}, |expected| {size:.3g}, shape {e.shape})"
    )


def tol(dtype) -> dict:
    return TOLERANCES[jnp.dtype(dtype)]


def qkv(
    seed: int, b: int, t: int, h: int, d: int, dv: int, s: int | None = None, dtype=jnp.float32
):
    """Random q ``[b,t,h,d]``, k ``[b,s,h,d]``, v ``[b,s,h,dv]`` (s defaults to t)."""
    s = t if s is None else s
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, h, dv), jnp.float32).astype(dtype)
    return q, k, v


def random_state(seed: int, b: int, h: int, f: int, dv: int) -> la.LinearAttentionState:
    """A non-trivial state with a positive denominator (as positive feature maps give)."""
    ks, kz = jax.random.split(jax.random.PRNGKey(seed))
    return la.LinearAttentionState(
        s=jax.random.normal(ks, (b, h, f, dv), jnp.float32),
        z=jax.random.uniform(kz, (b, h, f), jnp.float32, 0.5, 2.0),
    )


def key_mask(seed: int, b: int, s: int, p: float = 0.75):
    """Random bool ``[b, s]`` with at least the first key kept."""
    m = jax.random.bernoulli(jax.random.PRNGKey(seed), p, (b, s))
    return m.at[:, 0].set(True)


def gate(seed: int, b: int, t: int, h: int):
    """Log-decay ``[b, t, h]`` in (-inf, 0)."""
    return -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(seed), (b, t, h)))


def segment_ids(seed: int, b: int, t: int, p: float = 0.15):
    """Non-decreasing int32 ids ``[b, t]``: a new segment starts with probability p."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed), p, (b, t))
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def device_env(devices: int) -> dict:
    """This process's environment for a new one whose CPU has ``devices`` devices: the XLA
    flags tests/conftest.py set (compile speed) kept, the device count added."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return os.environ | {"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}


def pytest_with_devices(devices: int, *args: str) -> str:
    """Runs ``pytest *args`` in a new process whose CPU has ``devices`` devices (one
    process, ``-n 0``: two xdist workers there would each start JAX and compile the shared
    programs again, on the cores the calling run's other worker also uses); asserts it
    passed and returns its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args],
        env=device_env(devices),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return result.stdout


# ------------------------------------------------------- checkpoints against transformers
# (torch is imported inside: these run only in the checkpoint tests, which importorskip it)


def from_torch(torch_model, path) -> tuple:
    """``(our model, our config)`` of ``torch_model`` saved by ``transformers`` to ``path``."""
    from linattn_jax import hf

    torch_model.save_pretrained(path)
    return hf.from_pretrained(path)


def torch_logits(torch_model, tokens, mask=None) -> np.ndarray:
    """``torch_model``'s logits of int ``tokens [b, t]`` (any array), under an attention
    ``mask`` where given."""
    import torch

    with torch.no_grad():
        mask = None if mask is None else torch.tensor(np.asarray(mask), dtype=torch.long)
        return torch_model(torch.tensor(np.asarray(tokens)), attention_mask=mask).logits.numpy()


def assert_greedy_tokens_match(model, torch_model, prompt, steps: int = 16) -> None:
    """Our greedy decoding of ``steps`` tokens after ``prompt [b, t]`` equals
    ``transformers``' (no early stop), the prompt and every new token."""
    import torch

    ours = np.asarray(model.generate(jnp.asarray(prompt, jnp.int32), steps, temperature=0.0))
    with torch.no_grad():
        theirs = torch_model.generate(
            torch.tensor(np.asarray(prompt)), max_new_tokens=steps, do_sample=False,
            min_new_tokens=steps,
        ).numpy()  # fmt: skip
    np.testing.assert_array_equal(ours, theirs)


def assert_same_params(model, other) -> None:
    """The two models' parameters: the same paths, bit for bit the same values."""
    flat = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (model, other))
    for (path, x), (path_other, y) in zip(*flat, strict=True):
        assert path == path_other
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]))


def assert_same_torch_tensors(torch_model, other) -> None:
    """Every tensor of ``other``'s state dict (buffers too) is ``torch_model``'s, bit for bit."""
    state = torch_model.state_dict()
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(state[key].numpy(), value.numpy(), err_msg=key)


def assert_save_round_trip(model, config, torch_model, path):
    """``hf.save_pretrained(model, path, config)`` loads back as ``config`` and the same
    parameters; returns ``transformers``' model (``torch_model``'s class) read from ``path``."""
    from linattn_jax import hf

    hf.save_pretrained(model, path, config)
    again, again_config = hf.from_pretrained(path)
    assert again_config == config
    assert_same_params(again, model)
    assert_saved_alike_without_config(model, path)
    return type(torch_model).from_pretrained(path).eval()


def assert_saved_alike_without_config(model, path) -> None:
    """``hf.save_pretrained(model, path + "_bare")`` without a config (the one the model
    carries, ``model.hf_config``) writes ``path``'s files byte for byte (``path``: the
    model saved with the config it was loaded with)."""
    import pathlib

    from linattn_jax import hf

    path = pathlib.Path(path)
    bare = path.with_name(path.name + "_bare")
    hf.save_pretrained(model, bare)
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted(p.name for p in bare.iterdir())
    for name in names:
        assert (path / name).read_bytes() == (bare / name).read_bytes(), name


def load_state_dict(torch_model, path, config_dir):
    """Our model of ``torch_model``'s in-memory state dict (``transformers``' own names and
    layout), written to ``path`` as one safetensors file beside ``config_dir``'s config."""
    import shutil

    import safetensors.torch

    from linattn_jax import hf

    state = {k: v.clone().contiguous() for k, v in torch_model.state_dict().items()}
    safetensors.torch.save_file(state, str(path / "model.safetensors"))
    shutil.copy(os.path.join(config_dir, "config.json"), path / "config.json")
    return hf.from_pretrained(path)[0]


def prefill_then_steps(model, tokens, prefill: int, state):
    """The logits of ``tokens [b, t]`` run as a prefill of the first ``prefill`` from
    ``state`` and then one decoding step per token (jitted), concatenated over time."""

    def run(tokens, state):
        return call(model, jnp.asarray(tokens, jnp.int32), state=state, return_state=True)

    logits, state = run(tokens[:, :prefill], state)
    outs = [logits]
    for i in range(prefill, tokens.shape[1]):
        logits, state = run(tokens[:, i : i + 1], state)
        outs.append(logits)
    return jnp.concatenate(outs, 1)


def randomized(torch_model, norm_mean: float):
    """``torch_model`` with random norms (``N(norm_mean, 0.3)``), and its MoE routers and
    experts, where it has them, far from uniform."""
    import torch

    with torch.no_grad():
        for key, p in torch_model.named_parameters():
            if "norm" in key:
                p.normal_(norm_mean, 0.3)
            elif key.endswith("mlp.gate.weight") or key.endswith("experts.gate_up_proj"):
                p.normal_(0.0, 0.5)
            elif key.endswith("experts.down_proj"):
                p.normal_(0.0, 0.1)
    return torch_model


def randomized_named(torch_model, suffixes: tuple[str, ...], std: float):
    """``torch_model`` with every parameter and buffer whose name ends in one of
    ``suffixes`` drawn from ``N(0, std)`` (in place), so that a mapping error shows."""
    import torch

    with torch.no_grad():
        for name, p in [*torch_model.named_parameters(), *torch_model.named_buffers()]:
            if name.endswith(suffixes):
                p.normal_(0.0, std)
    return torch_model


def randomized_biases(torch_model):
    """``torch_model`` with random biases and routers' correction biases (``N(0, 0.5)``;
    ``transformers`` makes them 0), so that a mapping error shows."""
    return randomized_named(torch_model, (".bias", "e_score_correction_bias"), 0.5)


def randomized_mamba(torch_model):
    """``torch_model`` with random ``A_log``, ``dt_bias``, ``D`` and convolution biases
    (``N(0, 1)``) and norms (``1 + 0.5 N(0, 1)``), so that a mapping error shows."""
    import torch

    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D", "conv1d.bias")):
                p.copy_(torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return torch_model


def torch_pair(tmp_path_factory, name: str, make, norm_mean: float) -> tuple:
    """``(torch model, its directory, our model, our config)``: ``make()``'s model, made
    after seeding torch with 0 and ``randomized(..., norm_mean)``, saved by ``transformers``
    to a directory ``name`` and read back by ``hf.from_pretrained``."""
    import torch

    torch.manual_seed(0)
    ref = randomized(make().eval(), norm_mean)
    path = str(tmp_path_factory.mktemp(name))
    return (ref, path, *from_torch(ref, path))


def call(module, *args, **kwargs):
    """``module(*args, **kwargs)`` as one compiled program (``nnx.jit``; state the call
    writes, such as a MoE layer's losses, written back). Eagerly, each operation of the
    forward compiles as a program of its own (a MoE layer's: about 100, each a fixed ~20 ms
    of MLIR and XLA:CPU set-up), which was most of such a test's time. Keyword arguments
    that are pytrees of arrays (masks, states) are traced; the rest (``return_state=True``)
    are static."""
    arrays = {k: v for k, v in kwargs.items() if _all_arrays(v)}
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    return _call(module, args, arrays, options)


def _all_arrays(tree) -> bool:
    return all(isinstance(leaf, jax.Array | np.ndarray) for leaf in jax.tree.leaves(tree))


@nnx.jit(static_argnames="options")
def _call(module, args, arrays, options):
    return module(*args, **arrays, **dict(options))


# A model's logits, compiled once per model structure and shape (a Mamba-2 hybrid's eager
# forward takes about four times its compile's CPU time).
def forward(model, tokens, mask):
    return call(model, tokens, key_mask=mask)


def unmasked(model, tokens):
    return call(model, tokens)


def logits(model, tokens, mask=None):
    """Our ``model``'s logits (``forward``) of int ``tokens [b, t]`` (any array), under a
    bool key ``mask`` where given (else all ones)."""
    mask = np.ones(np.shape(tokens), bool) if mask is None else mask
    return forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask))


def assert_left_padded_row_alone(model, torch_model, tokens, pad: int, rtol: float) -> None:
    """Our logits of ``tokens [b, t]`` with row 0 left-padded by ``pad`` (masked) tokens:
    that row's real part equals ``torch_model``'s of it alone, the other rows theirs,
    normwise to ``rtol``."""
    mask = np.ones(np.shape(tokens), bool)
    mask[0, :pad] = False
    ours = np.asarray(logits(model, tokens, mask))
    assert_close_normwise(ours[1:], torch_logits(torch_model, tokens[1:]), rtol)
    assert_close_normwise(ours[0, pad:], torch_logits(torch_model, tokens[:1, pad:])[0], rtol)


def assert_decoding_matches(model, torch_model, tokens, rtol: float) -> None:
    """A prefill of 12 of ``tokens [b, t]`` then one step per token equals the full pass
    (normwise to ``rtol``), and greedy decoding after ``tokens[:1, :6]`` ``transformers``'."""
    full = logits(model, tokens)
    steps = prefill_then_steps(model, tokens, 12, model.init_state(*np.shape(tokens)))
    assert_close_normwise(steps, full, rtol)
    assert_greedy_tokens_match(model, torch_model, tokens[:1, :6])


def assert_matches_decodes_and_pads(pair, vocab: int, rtol: float) -> None:
    """``pair`` (``torch_pair``'s) against ``transformers``: the logits of random tokens
    ``[3, 17]`` normwise to ``rtol``, ``assert_decoding_matches`` (a prefill of 12 then
    steps, 16 greedy tokens) and ``assert_left_padded_row_alone`` (row 0 padded by 4)."""
    ref, _, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, vocab, (3, 17))
    assert_close_normwise(logits(model, tokens), torch_logits(ref, tokens), rtol)
    assert_decoding_matches(model, ref, tokens, rtol)
    assert_left_padded_row_alone(model, ref, tokens, 4, rtol)


def assert_round_trips(pair, path):
    """``assert_save_round_trip`` of ``pair``'s model to ``path / "ours"``; ``transformers``'
    model read from there holds every tensor of ``pair``'s, bit for bit (returned)."""
    ref, _, model, config = pair
    back = assert_save_round_trip(model, config, ref, path / "ours")
    assert_same_torch_tensors(back, ref)
    return back


def assert_reads_the_fused_layout(pair, path) -> None:
    """``pair``'s checkpoint as ``transformers`` holds it in memory (a mixture's experts
    fused: ``load_state_dict``, to ``path / "fused"``) loads to the same parameters."""
    ref, directory, model, _ = pair
    (path / "fused").mkdir()
    assert_same_params(load_state_dict(ref, path / "fused", directory), model)


def saved_without_config(model, torch_model, path, **options):
    """``transformers``' model (``torch_model``'s class) of ``hf.save_pretrained(model,
    path, **options)`` without a config (the model's own)."""
    from linattn_jax import hf

    hf.save_pretrained(model, path, **options)
    return type(torch_model).from_pretrained(path).eval()


def assert_matches_and_saves(torch_model, path, vocab: int, rtol: float = 1e-5):
    """Our model of ``torch_model`` (saved by ``transformers`` to ``path / "hf"``) gives its
    logits (normwise to ``rtol``), and saved without a config (the one it carries)
    ``transformers`` reads it back to the same logits; returns ``(model, config)``."""
    import pathlib

    path = pathlib.Path(path)
    model, config = from_torch(torch_model, path / "hf")
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 7))
    expected = torch_logits(torch_model, tokens)
    assert_close_normwise(logits(model, tokens), expected, rtol)
    back = saved_without_config(model, torch_model, path / "ours")
    assert_close_normwise(torch_logits(back, tokens), expected, rtol)
    return model, config


# ------------------------------------------------- the Mamba-2 hybrids (Falcon-H1, Granite)


def assert_logits_greedy_and_round_trip(model, config, torch_model, path, vocab: int) -> dict:
    """Our logits of random tokens equal ``torch_model``'s (normwise), 16 greedy tokens
    match, ``assert_save_round_trip`` to ``path / "ours"`` holds and ``transformers`` reads
    it to our logits; returns the config ``hf.save_pretrained`` writes without one (to
    ``path / "bare"``)."""
    import jax

    from linattn_jax import hf

    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 13), 2, vocab)
    assert_close_normwise(unmasked(model, tokens), torch_logits(torch_model, tokens))
    assert_greedy_tokens_match(model, torch_model, tokens[:1, :5])
    # Save, load back bit-identical; transformers reads our directory to the same logits.
    theirs = assert_save_round_trip(model, config, torch_model, path / "ours")
    short = tokens[:1, :7]
    assert_close_normwise(unmasked(model, short), torch_logits(theirs, short))
    # Without a config, the model's form picks its model type.
    hf.save_pretrained(model, path / "bare")
    return hf.read_config(path / "bare")


def assert_decode_steps_and_left_padding(model, vocab: int) -> None:
    """A prefill of 6 tokens then one step per token equals the full forward, and a row
    left-padded by 3 (its padding any id) equals the row alone (to 2e-5)."""
    import jax

    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 2, vocab)
    full = unmasked(model, tokens)
    steps = prefill_then_steps(model, tokens, 6, model.init_state(2))
    np.testing.assert_allclose(steps, full, rtol=2e-5, atol=2e-5)
    mask = jnp.array([[False] * 3 + [True] * 6, [True] * 9])
    padded = tokens.at[0, 3:].set(tokens[0, :6])
    out = forward(model, padded, mask)  # causal: full[0, :6] is the row's first 6 alone
    np.testing.assert_allclose(out[0, 3:], full[0, :6], rtol=2e-5, atol=2e-5)


def assert_init_from_builds(model, torch_model, path) -> None:
    """``--config.init_from=DIR`` of the directory ``transformers`` saves ``torch_model``
    to (``path / "hf"``): the run's model is ``model``, parameter for parameter."""
    from experiments import trainer
    from tests.test_experiments import tiny_config

    torch_model.save_pretrained(path / "hf")
    built = trainer.build_model(tiny_config("configs/mqar.py:small", f"init_from={path / 'hf'}"))
    assert_same_params(model, built)
