"""Falcon-Mamba checkpoints in Hugging Face format (``FalconMambaForCausalLM``,
``model_type`` ``falcon_mamba``) <-> ``LanguageModel``: Mamba (``hf.mamba``: the same
tensors, fields and frame) with weightless RMS norms on the mixer's ``dt`` (before
``dt_proj``), ``B`` and ``C``, of epsilon ``mixer_rms_eps`` (our ``MambaMixer``'s
``mixer_rms_eps``). The norms' ``weight`` buffers are not saved (ones, unused)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, mamba

MODEL_TYPES = ("falcon_mamba",)


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Mamba's, each mixer with ``mixer_rms_eps``."""
    mixer = mamba.mixer_options(config, mixer_rms_eps=float(config["mixer_rms_eps"]))
    return {**mamba.options(config), "kind_options": {"mamba": mixer}}


FORMAT = mamba.FORMAT.derive(
    name="Falcon-Mamba",
    model_types=MODEL_TYPES,
    architecture="FalconMambaForCausalLM",
    steps=mamba.FORMAT.steps
    + (
        common.defaults(dict(mixer_rms_eps=1e-6)),
        lambda config: common.check_number(config, "mixer_rms_eps", 0, 1),
    ),
    options=options,
)
