"""The on-disk format of a checkpoint, owned here and nowhere else.

* ``metadata.py``: the schema of ``metadata.json`` (dataclasses, JSON, validation), dtype table, file names of a
  checkpoint directory (``metadata.json``, ``COMMIT``, ``latest``, ``.parts``, ``<rank>_0.safetensors``).
* ``commit.py``: writing ``metadata.json`` then the ``COMMIT`` record, and ``read_metadata`` of a committed
  checkpoint (with a diagnosis of directories that are not one).
* ``safetensors.py``: the one safetensors header builder and the one parser.
* ``reserved.py``: the reserved ``__fsdp__.*`` value keys of the one-call API.
* ``regions.py``: ``read_region``, the one reader of a region of a saved tensor (load, full loads, tools), and
  ``iter_piece`` (verify).

Writers and readers elsewhere (save.py, load.py, verify.py, tools/) call these; a format change is made here.

Import the submodule that owns a name (``from ..format.metadata import CheckpointMetadata``): one import path per
name, and importing the package pulls in no I/O code.
"""
