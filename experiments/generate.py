"""Writes text with a pretrained checkpoint in Hugging Face format (any of ``hf.MODEL_TYPES``).

    python -m experiments.generate --checkpoint DIR --prompt "The capital of France is"
    python -m experiments.generate --checkpoint DIR --prompt "a" --prompt "b" \
        --steps 64 --temperature 0.7 --top-p 0.9 --seed 1

``DIR`` holds ``config.json``, the safetensors and ``tokenizer.json`` (``linattn_jax.hf``);
nothing is downloaded. Greedy unless ``--temperature`` is above 0; each prompt's text is
printed after it, one prompt per paragraph; each text ends at the config's
``eos_token_id`` (at any of them, where it lists several). A bad directory or flag is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax

from experiments import cli
from linattn_jax import hf


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.generate",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a Hugging Face directory")
    p.add_argument(
        "--prompt", required=True, action="append", help="the text to continue (repeatable)"
    )
    p.add_argument("--steps", type=int, default=64, help="the most new tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling's mass")
    p.add_argument("--seed", type=int, default=0, help="the sampling's PRNG seed")
    p.add_argument(
        "--dtype", choices=hf.pretrained.DTYPES, default=None, help="default: the config's"
    )
    p.add_argument("--verbose", action="store_true", help="print an error's traceback")
    cli.add_compilation_cache(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Prints each prompt and its continuation; returns the exit status."""
    args = parser().parse_args(argv)
    cli.use_compilation_cache(args.compilation_cache)
    try:
        tokenizer = hf.load_tokenizer(args.checkpoint)
        model, config = hf.from_pretrained(args.checkpoint, args.dtype)
        texts = hf.generate_text(
            model,
            tokenizer,
            args.prompt,
            args.steps,
            jax.random.key(args.seed),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=hf.eos_ids(config),
        )
    except ValueError as e:
        return cli.report("python -m experiments.generate", e, args.verbose)
    print("\n\n".join(p + t for p, t in zip(args.prompt, texts, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
