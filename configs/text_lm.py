"""Byte-level language modelling on the Python standard library's own sources
(a fixed sorted file list and a fixed train/validation split); reports bits
per byte and samples text with ``generate``.

    python -m experiments.train --config configs/text_lm.py --workdir runs/text_lm
    python -m experiments.train --config configs/text_lm.py:small --workdir runs/text_lm_small
"""

from ml_collections import ConfigDict

from configs import common


def get_config(arg: str | None = None) -> ConfigDict:
    c = common.base()
    c.task = "text_lm"
    c.text = ConfigDict(
        dict(num_files=64, val_fraction=0.1, sample_prompt="def ", sample_length=120)
    )
    c.seq_len = 512
    c.steps = 3000
    c.batch_size = 32
    c.model.width = 256
    c.model.depth = 4
    c.model.num_heads = 4
    c.optim.lr = 1e-3
    if arg == "small":
        c.text.num_files = 16
        c.seq_len = 128
        c.steps = 1500
        c.batch_size = 16
        c.eval_every = 500
        c.checkpoint_every = 500
        c.log_every = 25
        c.model.width = 64
        c.model.num_heads = 2
        c.optim.warmup_steps = 30
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/text_lm.py (try 'small')")
    c.lock()
    return c
