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
    c.progress = True  # tqdm's bar on a terminal, a line per log_every steps off one
    c.resume = True  # resume from the workdir's checkpoints (false: empty the workdir first)
    # A Hugging Face directory (Qwen3.5, linattn_jax.hf) to fine-tune from: its config.json
    # sets the model (model.* unread but model.dtype); "": a random initialisation.
    c.init_from = ""

    c.mesh = ConfigDict()
    # The mesh: data x fsdp x sequence x tensor devices, data taking what the others leave.
    c.mesh.fsdp = 1  # parameters and optimizer state split (and batches, with data)
    c.mesh.tensor = 1  # heads and MLP hidden units split (tensor parallelism)
    c.mesh.sequence = 1  # devices along the sequence (sequence-parallel linear attention)
    c.mesh.expert = 1  # a mixture's experts split (expert parallelism; batches split too)

    # Several processes, one per host (experiments.distributed): every process runs the same
    # command but for its process_id; 0 and "" are left to JAX's detection of the cluster.
    c.distributed = ConfigDict()
    c.distributed.num_processes = 1  # 1: one process; 0: detected (SLURM, Open MPI, TPU, ...)
    c.distributed.process_id = -1  # this process's index in [0, num_processes) (-1: detected)
    c.distributed.coordinator_address = ""  # "host:port" of process 0 ("": detected)
    c.distributed.cpu_collectives = "gloo"  # across processes on CPUs: "gloo" or "mpi"
    c.distributed.initialization_timeout = 300  # seconds to wait for every process to join
    c.distributed.heartbeat_timeout = 100  # seconds without a sign of life: a peer is lost

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
    c.model.mlp = "gelu"  # or "swiglu", or "moe" (a mixture of experts: model.moe)
    c.model.mlp_hidden = 0  # the MLP's hidden width (0: mlp_ratio * width)
    c.model.zero_centred_norm = False  # RMSNorms as x * (1 + w) (Qwen3-Next, Qwen3.5)
    c.model.scan_layers = False  # scan over the layout's period (compile time flat in depth)
    c.model.remat = "none"  # "none", "full" or "dots_saveable"
    # Softmax layers' own options (model.attention "softmax" or a layout with it); 0: default.
    c.model.softmax = ConfigDict()
    c.model.softmax.num_heads = 0  # 0: model.num_heads
    c.model.softmax.num_kv_heads = 0  # GQA (0: num_heads)
    c.model.softmax.head_dim = 0  # 0: width / num_heads
    c.model.softmax.rope = False
    c.model.softmax.rope_theta = 10000.0
    c.model.softmax.partial_rotary_factor = 1.0
    c.model.softmax.qk_norm = False
    c.model.softmax.zero_centred_qk_norm = False
    c.model.softmax.output_gate = False  # gated attention: out * sigmoid(gate)
    c.model.softmax.sliding_window = 0  # 0: none
    # Delta-rule layers' own options (deltanet, gated_deltanet, kda); 0: default.
    c.model.delta = ConfigDict()
    c.model.delta.num_heads = 0  # key heads (0: model.num_heads)
    c.model.delta.num_v_heads = 0  # grouped value heads (0: num_heads)
    c.model.delta.head_dim = 0  # dk (0: width / num_heads)
    c.model.delta.value_head_dim = 0  # dv (0: dk)
    c.model.delta.conv_size = 4
    # Mamba-2 layers' own options (model.attention "mamba2" or a layout with it); 0: default.
    c.model.mamba2 = ConfigDict()
    c.model.mamba2.num_heads = 0  # SSD heads (0: model.num_heads)
    c.model.mamba2.head_dim = 0  # p (0: expand * width / num_heads)
    c.model.mamba2.expand = 0  # inner / width (0: Mamba-2's 2)
    c.model.mamba2.state_dim = 0  # n (0: Mamba-2's 128)
    c.model.mamba2.n_groups = 0  # B/C groups (0: 1)
    c.model.mamba2.conv_size = 4
    # The mixture of experts (model.mlp "moe"; linattn_jax.layers.moe.MoE).
    c.model.moe = ConfigDict()
    c.model.moe.num_experts = 8  # routed experts
    c.model.moe.top_k = 2  # experts per token
    c.model.moe.hidden = 0  # each expert's hidden width (0: model.mlp_hidden's)
    c.model.moe.score = "softmax"  # or "sigmoid"
    c.model.moe.normalize = False  # the top-k weights over their sum (norm_topk_prob)
    c.model.moe.scaling = 1.0  # routed_scaling_factor
    c.model.moe.score_bias = False  # a selection-only bias (e_score_correction_bias)
    c.model.moe.num_groups = 1  # grouped top-k (n_group; 1: none)
    c.model.moe.top_k_groups = 1  # groups chosen from (topk_group)
    c.model.moe.shared_hidden = 0  # a shared SwiGLU expert's hidden width (0: none)
    c.model.moe.shared_gate = False  # its sigmoid gate (Qwen3-Next)
    c.model.moe.first_dense = 0  # the first layers keep a SwiGLU MLP (first_k_dense_replace)

    c.optim = ConfigDict()
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.accumulate = 1  # micro-batches per step (gradients summed; batch_size is the step's)
    # Added to the loss, times the mean over MoE layers (model.mlp "moe"); 0: off.
    c.optim.load_balancing_loss = 0.0  # Switch's auxiliary loss (e.g. 0.01)
    c.optim.router_z_loss = 0.0  # ST-MoE's router z-loss (e.g. 1e-3)
    return c
