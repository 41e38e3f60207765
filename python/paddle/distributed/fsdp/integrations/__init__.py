"""Integrations of FullyShardFusion with training frameworks; each imports its framework only when used.

* ``paddleformers``: ``FSDPTrainer``, a drop-in ``paddleformers.trainer.Trainer`` (PaddleFormers 1.2.0) that shards
  the model with FullyShardFusion and checkpoints, resumes and exports through this package (docs/trainer.md).
"""
