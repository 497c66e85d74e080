"""Experiments: data, the trainer and its command lines, benchmarks."""

from experiments.trainer import load

__all__ = ["load"]
