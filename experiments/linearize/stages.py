"""The two stages' objectives and jitted steps.

* Stage 1, attention transfer (Hedgehog, LoLCATs): each swapped layer, fed the teacher's
  own attention input (``capture.attention_io``), is trained to give the teacher's attention
  output: its loss is the mean squared error over the output's mean square (scale-free, so
  that layers compare), plus ``ce_weight`` times the cross-entropy of the teacher's
  attention weights under the student's (Hedgehog's loss; ``LinearizedAttention`` only).
  Only the new parameters train (``student.NewParams``).
* Stage 2, fine-tuning: LoRA adapters on the swapped layers' q/k/v/o projections (Flax's
  ``nnx.LoRA`` wrapping each ``nnx.Linear``; ``merge_lora`` folds them back), or every
  parameter, on the language-model loss plus ``kl_weight`` times the KL divergence from the
  teacher's next-token distribution to the student's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.linearize.capture import attention_io
from linattn_jax.layers.linearized import LinearizedAttention

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def transfer_losses(student, io: dict, ce_weight: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """``(relative MSE [n], attention-weight cross-entropy [n])`` of the student's layers
    ``io``'s keys, each fed its captured input (``io``: ``attention_io``'s, layers in
    order); the cross-entropy is 0 unless ``ce_weight``."""
    mse, ce = [], []
    for i, (x, y) in io.items():
        layer = student.blocks[i].attention
        y = jax.lax.stop_gradient(y.astype(jnp.float32))
        error = layer(x).astype(jnp.float32) - y
        mse.append(jnp.mean(error**2) / jnp.maximum(jnp.mean(y**2), 1e-12))
        if ce_weight:
            if not isinstance(layer, LinearizedAttention):
                raise ValueError(
                    f"ce_weight needs LinearizedAttention layers, layer {i} is a "
                    f"{type(layer).__name__}"
                )
            teacher, weights = layer.attention_weights(x)
            cross = -jnp.sum(teacher * jnp.log(jnp.maximum(weights, 1e-30)), axis=-1)
            ce.append(jnp.mean(cross))
        else:
            ce.append(jnp.zeros(()))
    return jnp.stack(mse), jnp.stack(ce)


@nnx.jit(static_argnames=("layers", "new", "ce_weight"))
def transfer_step(teacher, student, optimizer, tokens, layers, new, ce_weight: float = 0.0):
    """One step of stage 1 on ``tokens [b, t]``: ``{"loss", "mse" [n], "ce" [n],
    "grad_norm"}`` (``loss`` the objective's sum over the layers)."""
    _, io = attention_io(teacher, tokens, layers)

    def objective(student):
        mse, ce = transfer_losses(student, io, ce_weight)
        return jnp.sum(mse + ce_weight * ce), (mse, ce)

    grad_fn = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, new), has_aux=True)
    (loss, (mse, ce)), grads = grad_fn(student)
    optimizer.update(student, grads)
    return {"loss": loss, "mse": mse, "ce": ce, "grad_norm": _norm(grads)}


@nnx.jit(static_argnames=("layers",))
def transfer_eval(teacher, student, tokens, layers):
    """Each swapped layer's relative MSE ``[n]`` on ``tokens``."""
    _, io = attention_io(teacher, tokens, layers)
    return transfer_losses(student, io)[0]


def _norm(tree) -> jax.Array:
    """The l2 norm of all of ``tree``'s leaves together."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def kl_to_teacher(logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
    """Mean over tokens of ``KL(teacher || student)`` of next-token distributions from
    ``[b, t, vocab]`` logits."""
    teacher_log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(teacher_log_p) * (teacher_log_p - log_p), axis=-1))


def language_model_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of ``[b, t, vocab]`` logits on ``labels [b, t]``."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@nnx.jit(static_argnames=("wrt", "kl_weight"))
def finetune_step(teacher, student, optimizer, inputs, labels, wrt, kl_weight: float = 1.0):
    """One step of stage 2: ``{"loss", "lm", "kl", "grad_norm"}``, the objective ``lm +
    kl_weight * kl`` over the parameters ``wrt`` selects."""
    teacher_logits = jax.lax.stop_gradient(teacher(inputs))

    def objective(student):
        logits = student(inputs)
        lm, kl = language_model_loss(logits, labels), kl_to_teacher(logits, teacher_logits)
        return lm + kl_weight * kl, (lm, kl)

    grad_fn = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, wrt), has_aux=True)
    (loss, (lm, kl)), grads = grad_fn(student)
    optimizer.update(student, grads)
    return {"loss": loss, "lm": lm, "kl": kl, "grad_norm": _norm(grads)}


@nnx.jit
def logits(model, tokens):
    """``model(tokens)``, jitted."""
    return model(tokens)


@nnx.jit
def eval_loss(model, inputs, labels, weights):
    """Next-token cross-entropy and accuracy of ``model`` on one batch ``[b, t]``, each
    averaged over the positions of ``weights [b, t]`` (1 counted, 0 not)."""
    logits = model(inputs)
    total = jnp.maximum(jnp.sum(weights), 1.0)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return jnp.sum(loss * weights) / total, jnp.sum(correct * weights) / total


def add_lora(model, layers: tuple[int, ...], rank: int, seed: int = 0) -> None:
    """Wraps the q/k/v/o projections of ``model``'s attention layers ``layers`` in
    ``nnx.LoRA`` of ``rank`` (``A`` He-uniform, ``B`` zeros: the function is unchanged);
    their parameters are ``nnx.LoRAParam``."""
    rngs = nnx.Rngs(seed)
    for i in layers:
        attention = model.blocks[i].attention
        for name in PROJECTIONS:
            base = getattr(attention, name)
            lora = nnx.LoRA(
                base.in_features, rank, base.out_features, base_module=base,
                dtype=base.dtype, param_dtype=base.param_dtype, rngs=rngs,
            )  # fmt: skip
            setattr(attention, name, lora)


def merge_lora(model, layers: tuple[int, ...]) -> None:
    """Folds each ``nnx.LoRA`` of ``add_lora`` into its base ``nnx.Linear`` (``W + A B``)
    and puts the ``Linear`` back: the model ``add_lora`` was given, with new weights."""
    for i in layers:
        attention = model.blocks[i].attention
        for name in PROJECTIONS:
            lora = getattr(attention, name)
            if not isinstance(lora, nnx.LoRA):
                continue
            base = lora.base_module
            kernel = base.kernel[...]
            delta = lora.lora_a[...].astype(jnp.float32) @ lora.lora_b[...].astype(jnp.float32)
            base.kernel[...] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
            setattr(attention, name, base)
