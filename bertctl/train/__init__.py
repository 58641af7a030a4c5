"""Pretraining: optimizers and schedules (``optim``), the training loop (``pretrain``), checkpoints
(``state``), the prefetching loader (``loader``), process groups (``distributed``) and FLOP counts /
curves (``metrics``)."""
