"""Fields shared by every experiment config; each config file fills in its task."""

from ml_collections import ConfigDict


def base() -> ConfigDict:
    c = ConfigDict()
    c.task = ""
    c.seed = 0
    c.steps = 1000
    c.batch_size = 32  # global, split over all devices
    c.seq_len = 256
    c.log_every = 50
    c.eval_every = 200
    c.eval_batches = 4
    c.checkpoint_every = 200
    c.keep_checkpoints = 2
    c.stop_at = 0  # stop after this step without changing the schedule (0: run to `steps`)
    c.progress = True  # tqdm progress bar (only when the output is a terminal)
    c.resume = True  # resume from the workdir's checkpoints (false: empty the workdir first)

    c.mesh = ConfigDict()
    c.mesh.sequence = 1  # devices along the sequence (sequence-parallel linear attention)

    c.model = ConfigDict()
    c.model.attention = "linear"  # a kind of linattn_jax.layers.ATTENTION_KINDS
    c.model.feature_map = "elu"
    c.model.method = "chunked"
    c.model.chunk_size = 0  # tokens per chunk (0: the family's default)
    c.model.decay = ""  # "", "retnet" or a float in (0, 1]
    c.model.gate = False
    c.model.normalize = True
    c.model.num_features = 0  # random features: m (0: 2 * head_dim)
    c.model.feature_dim = 0  # Based: q, k projected to this many dims per head (0: head_dim)
    c.model.width = 128
    c.model.depth = 2
    c.model.num_heads = 4
    c.model.mlp_ratio = 4
    c.model.short_conv = 0  # causal depthwise convolution before attention (language models)
    c.model.dtype = "float32"

    c.optim = ConfigDict()
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    return c
