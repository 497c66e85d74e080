"""Experiments: data, the trainer and its command lines, benchmarks. ``load`` (a
trained model back from a workdir) is imported on first use, so that
``experiments.data`` needs neither optax nor orbax.
"""

from __future__ import annotations

__all__ = ["load"]


def __getattr__(name: str):
    if name == "load":
        from experiments.checkpoints import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
