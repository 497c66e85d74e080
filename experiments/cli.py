"""The command lines of ``train``, ``sweep`` and ``recall``: their shared flags,
``--config.<field>=<value>`` overrides, ``--print_config``'s listing, and errors
reported in one line with exit status 2 (a bad command line or config) or 1 (a run
that failed).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

import jax
from ml_collections import ConfigDict

from experiments.configuration import flatten, load_config, override

OVERRIDE_HELP = (
    "--config.<field>=<value> (or --config.<field> <value>) overrides any field of the "
    "config, e.g. --config.model.width=128 --config.optim.lr=3e-4; --print_config lists "
    "the fields. Errors (a misspelt field, a bad value, a workdir of another config) are "
    "one line on stderr and exit status 2; a run that fails (a non-finite loss, a full "
    "disk) exits with status 1; --verbose shows the traceback above that line."
)


class UsageError(ValueError):
    """A command line that cannot run (reported in one line, exit status 2)."""


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags shared by ``train``, ``sweep`` and ``recall``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=OVERRIDE_HELP, allow_abbrev=False
    )
    parser.add_argument(
        "--config",
        required=True,
        metavar="FILE[:VARIANT]",
        help="the experiment config: configs/<experiment>.py, optionally with a variant "
        "(configs/mqar.py:small calls get_config('small'))",
    )
    parser.add_argument(
        "--workdir",
        metavar="DIR",
        help="where checkpoints, metrics.jsonl, TensorBoard events and plots go; rerunning "
        "with the same workdir resumes there (required unless --print_config)",
    )
    parser.add_argument(
        "--print_config",
        action="store_true",
        help="print the config's fields and values (after any --config.<field> overrides) and exit",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="on an error, print its traceback above the one-line message, and let "
        "orbax's own logs of a failed save or restore through (held back otherwise)",
    )
    add_compilation_cache(parser)
    return parser


def default_compilation_cache() -> str:
    """``$XDG_CACHE_HOME/linattn_jax/jax`` (``~/.cache/linattn_jax/jax`` without it)."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "linattn_jax", "jax")


def add_compilation_cache(parser: argparse.ArgumentParser) -> None:
    """The ``--compilation_cache DIR`` flag (``use_compilation_cache``'s argument)."""
    parser.add_argument(
        "--compilation_cache",
        metavar="DIR",
        default=None,
        help="JAX's persistent compilation cache: programs compiled by an earlier run are "
        f"read back instead of compiled again (default: {default_compilation_cache()}, or "
        "JAX_COMPILATION_CACHE_DIR where set; '' or JAX_ENABLE_COMPILATION_CACHE=false turns "
        "it off; always off in a run of several processes on CPUs)",
    )


def use_compilation_cache(directory: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache in ``directory`` and returns it.

    None: ``JAX_COMPILATION_CACHE_DIR`` (or JAX's ``jax_compilation_cache_dir``) where the
    caller set one, else ``default_compilation_cache()``; ``""``: off (returns None). With
    None, a cache the caller turned off (``JAX_ENABLE_COMPILATION_CACHE=false``, or JAX's
    ``jax_enable_compilation_cache`` set False) stays off. Call it before the first
    compile: JAX opens its cache once per process. Which programs are cached is JAX's
    choice (those that took over ``jax_persistent_cache_min_compile_time_secs``, 1 s by
    default, to compile).
    """
    if directory is None:
        if not jax.config.jax_enable_compilation_cache:
            return None
        directory = jax.config.jax_compilation_cache_dir or default_compilation_cache()
    if not directory:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    return directory


def wants_verbose(argv: Sequence[str] | None) -> bool:
    """Whether the command line asks for ``--verbose`` (known before it is parsed, for the
    errors of parsing it)."""
    return "--verbose" in (sys.argv[1:] if argv is None else argv)


def parse(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, ConfigDict]:
    """Parses ``argv`` and applies its ``--config.<field>`` overrides.

    Raises:
      UsageError: an unknown flag or field, a bad value, or no ``--workdir``.
    """
    args, rest = parser.parse_known_args(argv)
    overrides, i = [], 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--config."):
            raise UsageError(f"unrecognised argument {token!r} (see --help)")
        assignment = token.removeprefix("--config.")
        if "=" not in assignment:
            if i + 1 == len(rest) or rest[i + 1].startswith("--"):
                raise UsageError(f"{token} needs a value: {token}=<value>")
            assignment, i = f"{assignment}={rest[i + 1]}", i + 1
        overrides.append(assignment)
        i += 1
    try:
        config = load_config(args.config)
        for assignment in overrides:
            override(config, assignment)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.workdir is None and not args.print_config:
        raise UsageError("--workdir is required (or --print_config)")
    return args, config


def format_config(config: ConfigDict) -> str:
    """One ``field = value`` line per field, as ``--config.<field>`` takes it."""
    fields = flatten(config)
    width = max(map(len, fields))
    show = lambda v: str(v).lower() if isinstance(v, bool) else (repr(v) if v == "" else str(v))
    return "\n".join(f"{name:<{width}} = {show(value)}" for name, value in fields.items())


def report(prog: str, error: BaseException, verbose: bool = False) -> int:
    """Prints ``error`` as one line (below its traceback when ``verbose``); returns the
    exit status."""
    if verbose:
        sys.stderr.write("".join(traceback.format_exception(error)))
    message = " ".join(str(error).split()) or type(error).__name__
    # One write, line and newline together: a failed orbax save's threads may print
    # to stderr at the same time, and print() writes the newline separately.
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    return 2 if isinstance(error, ValueError) else 1
