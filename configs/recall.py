"""The recall-memory trade-off (Zoology, Arora et al. 2024; Based, Arora et al. 2024).

MQAR accuracy against the recurrent state size, one line per attention kind, with
softmax attention (its KV cache at the test length) as the ceiling:

    python -m experiments.recall --config configs/recall.py --workdir runs/recall
    python -m experiments.recall --config configs/recall.py:small --workdir runs/recall_small

Each point is a 2-layer model of one width (one head, so that a linear state grows
as width²), trained on a mix of (sequence length, key-value pairs) splits in
Zoology's layout (queries scattered among noise tokens) and tested on a fixed set
of two splits, the second longer than any seen in training; the best of
``recall.lrs`` is kept per point. ``recall.*`` chooses the grid; the other fields
are those of ``configs/mqar.py`` and apply to every run.
"""

from ml_collections import ConfigDict

from configs import common


def get_config(arg: str | None = None) -> ConfigDict:
    c = common.base()
    c.task = "mqar"
    c.mqar = ConfigDict()
    c.mqar.num_pairs = 16
    c.mqar.vocab_size = 256  # 127 keys, 128 values (Zoology: 8192, beyond this CPU budget)
    c.mqar.spread = True
    c.mqar.train_mix = "32:4,64:8,128:16"  # Zoology's (64, 4), (128, 8), (256, 16), halved
    c.mqar.test_mix = "128:16,256:32"  # the second longer than any seen in training
    c.seq_len = 256  # the longest split
    c.steps = 1000
    c.batch_size = 8  # sequences of the longest training split: 1024 tokens a step
    c.eval_every = 500
    c.eval_batches = 16  # 128 test sequences of 128 tokens, 64 of 256 (the same in every run)
    c.checkpoint_every = 500
    c.log_every = 50
    c.model.depth = 2
    c.model.num_heads = 1
    c.model.width = 64
    c.model.chunk_size = 64
    c.model.short_conv = 4
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.1

    c.recall = ConfigDict()
    c.recall.kinds = (
        "softmax,elu,based,hedgehog,retnet,gla,deltanet,gated_deltanet,kda,mlstm,hybrid,mamba2,"
        "rwkv,mamba"
    )
    c.recall.widths = "64,96,128"
    c.recall.lrs = "3e-3,1e-2"
    if arg == "small":  # about 2.5 minutes on 2 CPU cores
        c.mqar.vocab_size = 128
        c.mqar.train_mix = "16:2,32:4,64:8"
        c.mqar.test_mix = "64:8,128:16"
        c.seq_len = 128
        c.batch_size = 16
        c.steps = 500
        c.eval_every = 250
        c.checkpoint_every = 250
        c.eval_batches = 4
        c.model.chunk_size = 32
        c.recall.kinds = "softmax,elu,based,deltanet"
        c.recall.widths = "32,64"
        c.recall.lrs = "1e-2"
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/recall.py (try 'small')")
    c.lock()
    return c
