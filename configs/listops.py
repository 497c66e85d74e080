"""ListOps (Long Range Arena; Tay et al. 2021): classify the value of nested
MIN/MAX/MED/SUM_MOD expressions with a non-causal linear-attention encoder.

    python -m experiments.train --config configs/listops.py --workdir runs/listops
    python -m experiments.train --config configs/listops.py:small --workdir runs/listops_small
"""

from ml_collections import ConfigDict

from configs import common


def get_config(arg: str | None = None) -> ConfigDict:
    c = common.base()
    c.task = "listops"
    c.listops = ConfigDict(dict(max_depth=10, max_args=10))
    c.seq_len = 2000
    c.steps = 5000
    c.batch_size = 32
    c.optim.lr = 5e-4
    if arg == "small":
        c.listops.max_depth = 4
        c.listops.max_args = 4
        c.seq_len = 128
        c.steps = 1000
        c.eval_every = 250
        c.checkpoint_every = 250
        c.log_every = 25
        c.model.width = 64
        c.model.num_heads = 2
        c.optim.lr = 1e-3
        c.optim.warmup_steps = 30
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/listops.py (try 'small')")
    c.lock()
    return c
