"""Linearising a pretrained softmax transformer (issue 52), behind ``python -m
experiments.linearize`` (``__main__``): the swap (``student``), the capture of the teacher's
attention inputs and outputs (``capture``), the two stages' steps (``stages``: attention
transfer; LoRA with the LM loss and a KL term), the corpus and the measures
(``evaluation``), the export (``export``), the report (``report``) and the resumable run
(``run``)."""
