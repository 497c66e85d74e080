"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology").

How well does the recurrent state store key-value pairs? A causal LM reads
``num_pairs`` key-value pairs, then is asked for each key's value.

    python -m experiments.train --config configs/mqar.py --workdir runs/mqar
    python -m experiments.train --config configs/mqar.py:small --workdir runs/mqar_small
    python -m experiments.sweep --config configs/mqar.py:small \
        --sweep attention=softmax,elu,taylor,favor_plus --workdir runs/mqar_sweep
"""

from ml_collections import ConfigDict

from configs import common


def get_config(arg: str | None = None) -> ConfigDict:
    c = common.base()
    c.task = "mqar"
    c.mqar = ConfigDict(dict(num_pairs=16, vocab_size=256))
    c.mqar.spread = False  # Zoology's layout: queries scattered among noise tokens
    c.mqar.train_mix = ""  # "seq_len:num_pairs,...": one split per step, in turn ("": seq_len)
    c.mqar.test_mix = ""  # "seq_len:num_pairs,...": eval sets reported apart, and their mean
    c.seq_len = 128
    c.steps = 2000
    c.batch_size = 64
    c.optim.lr = 3e-3
    c.model.short_conv = 4  # Zoology's models mix neighbouring tokens before attention
    if arg == "small":  # minutes on 2 CPU cores
        c.mqar.num_pairs = 8
        c.mqar.vocab_size = 64
        c.seq_len = 32
        c.steps = 1000
        c.batch_size = 32
        c.eval_every = 250
        c.checkpoint_every = 250
        c.log_every = 50
        c.model.width = 64
        c.model.num_heads = 2
        c.model.chunk_size = 16
        c.optim.warmup_steps = 30
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/mqar.py (try 'small')")
    c.lock()
    return c
