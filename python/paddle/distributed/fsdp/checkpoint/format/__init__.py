"""The on-disk format of a checkpoint, owned here and nowhere else.

* ``metadata.py``: the schema of ``metadata.json`` (dataclasses, JSON, validation: pieces never share bytes in a
  file), dtype table, file names of a checkpoint directory (``metadata.json``, ``COMMIT``, ``latest``, ``.parts``,
  ``<rank>_0.safetensors``).
* ``versions.py``: the registry of on-disk versions (``FORMATS``: 1, 2, 3, what each holds and its reader;
  ``WRITE_VERSION``) and ``loads_metadata``, reading ``metadata.json`` of any of them (format 1 through schema.py,
  formats 2 and 3 through index.py / index_view.py).
* ``commit.py``: writing ``metadata.json`` then the ``COMMIT`` record, and ``read_metadata`` of a committed
  checkpoint (with a diagnosis of directories that are not one).
* ``safetensors.py``: the one safetensors header builder and the one parser.
* ``reserved.py``: the reserved ``__fsdp__.*`` value keys of the one-call API.
* ``strict_json.py``: bounded, strict reading of the small JSON files (size cap before reading, regular files
  only and never blocking, no NaN/Infinity, depth and integer caps) and the writer's side of the same rules.
* ``schema.py``: every field of ``metadata.json`` and ``COMMIT`` typed, refusals naming the field.
* ``coverage.py``: the one exact-coverage check (overlaps and gaps) of a tensor by its pieces, bounded by the
  number of pieces (verify, loads, the save plan).
* not here: ``read_region`` / ``iter_piece``, the one reader of a region of a saved tensor, are in
  ``checkpoint/regions.py`` (it does I/O).

Writers and readers elsewhere (save/save.py, load/load.py, verify.py, tools/) call these; a format change is made here.

Import the submodule that owns a name (``from ..format.metadata import CheckpointMetadata``): one import path per
name, and importing the package pulls in no I/O code.
"""
