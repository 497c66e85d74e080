"""Linearising a softmax transformer (``experiments.linearize``): a student with the teacher's
attention layers swapped for a linear kind, trained by attention transfer (stage 1) and then
fine-tuned with LoRA, the language-model loss and a KL term to the teacher (stage 2);
compared with the teacher and with the student's architecture trained from scratch on the
same tokens.

    python -m experiments.linearize --config configs/linearize.py:small --workdir runs/lin_small
    python -m experiments.linearize --config configs/linearize.py --workdir runs/lin \
        --config.teacher_dir=/path/to/a/hf/llama --config.student.kind=lolcats

``teacher_dir`` "": the teacher is first trained here on the text corpus (``teacher``: a
``configs/text_lm.py`` config of a softmax model, into ``<workdir>/teacher``); else a
Hugging Face directory ``linattn_jax.hf.from_pretrained`` loads (its ``tokenizer.json``
tokenises the corpus; without one the corpus's bytes are the token ids).
"""

from ml_collections import ConfigDict

from configs import text_lm


def get_config(arg: str | None = None) -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    c.teacher_dir = ""  # a Hugging Face directory; "": train `teacher` first
    teacher = text_lm.get_config("small" if arg == "small" else None)
    teacher.unlock()
    teacher.model.attention = "softmax"
    teacher.model.mlp = "swiglu"
    teacher.model.softmax.rope = True
    teacher.text.num_files = 64
    c.teacher = teacher
    # The student's stages and the evaluation: batches of the teacher's corpus.
    c.batch_size = 16
    c.seq_len = 128
    c.student = ConfigDict()
    c.student.kind = "lolcats"  # hedgehog, lolcats, t2r, liger or gated_deltanet
    c.student.window = 32  # lolcats: softmax over the latest `window` tokens
    c.student.keep_softmax = ""  # "", "0,3", "every:4" or "ranked:2": layers kept softmax
    c.student.conv_size = 4  # gated_deltanet's short convolution (identity at the start)
    c.transfer = ConfigDict()  # stage 1: the new parameters only
    c.transfer.steps = 200
    c.transfer.lr = 1e-2
    c.transfer.warmup_steps = 10
    c.transfer.ce_weight = 0.0  # Hedgehog's attention-weight cross-entropy (0: MSE alone)
    c.finetune = ConfigDict()  # stage 2: LoRA (and the new parameters), LM loss + KL
    c.finetune.steps = 200
    c.finetune.lr = 3e-3
    c.finetune.warmup_steps = 10
    c.finetune.lora_rank = 8  # 0: every parameter (full fine-tuning)
    c.finetune.kl_weight = 1.0
    c.scratch = ConfigDict()  # the student's architecture from scratch, the same tokens
    c.scratch.lr = 3e-3
    c.scratch.warmup_steps = 10
    c.eval_batches = 8
    c.eval_every = 50
    # The recall probe: held-out windows of seq_len / 2 tokens repeated, the copy predicted.
    c.copy_batches = 2
    c.log_every = 10
    c.checkpoint_every = 100
    c.keep_checkpoints = 2
    c.progress = True
    c.resume = True
    if arg == "small":
        c.teacher.steps = 800
        c.teacher.eval_every = 400
        c.teacher.checkpoint_every = 400
        c.teacher.log_every = 50
        c.teacher.text.sample_length = 60
        c.transfer.steps = 20
        c.finetune.steps = 20
        c.eval_every = 10
        c.eval_batches = 4
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/linearize.py (try 'small')")
    c.lock()
    return c
