"""The FSDP side of checkpointing: what a FullyShardFusion model and its optimizer save, and how it resumes.

* ``records.py``: each rank's parameter pieces and optimizer state as ShardedWeight records (no gathering).
* ``optimizer_states.py``: the per-optimizer-class table naming every accumulator, and the discovery of each
  param's state tensors; ``optimizer_json_state.py``: the non-tensor state (learning rate, scheduler) as JSON;
  ``optimizer_state_creation.py``: making the state exist before a load and writing into it in place.
* ``resume_state.py``: what a resume holds (``ITEMS``), built and applied in one place for every door.
* ``resume.py``: the one-call ``save_checkpoint`` / ``load_checkpoint`` built on the engine in
  ``paddle.distributed.fsdp.checkpoint``: the implementation behind the ``FullyShardFusion`` methods, which are
  the door (they check the keywords; docs/save-load.md "The doors"); the memory tier (``memtier/``) is the other.
* ``grad_scaler.py``, ``rng.py``, ``buffers.py``, ``stateful.py`` (objects with ``state_dict()``, the data
  sampler), ``ema.py`` (a sharded EMA of the weights): the items' own encodings.

Data flows one way: model -> buffers -> records (here) -> storage (``checkpoint/``).
"""
