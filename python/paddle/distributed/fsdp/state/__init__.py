"""The FSDP side of checkpointing: what a FullyShardFusion model and its optimizer save, and how it resumes.

* ``records.py``: each rank's parameter pieces and optimizer state as ShardedWeight records (no gathering).
* ``optimizer_states.py``: the per-optimizer-class table naming every accumulator and non-tensor state.
* ``resume.py``: the one-call ``save_checkpoint`` / ``load_checkpoint`` (tensors, optimizer, LR scheduler,
  RNG, ``extra_state``) built on the engine in ``paddle.distributed.fsdp.checkpoint``.

Data flows one way: model -> buffers -> records (here) -> storage (``checkpoint/``).
"""
