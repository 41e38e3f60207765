"""Type mutations of a JSON document: every field replaced by a value of every other JSON type (issue 29).

Why: value fuzzing (random junk at random nodes) rarely gives a field the one wrong type that reaches Python as an
internal error (``"transposed": [["x"]]`` made from-hf fail with ``TypeError: unhashable type: 'list'``). Here the
fields are enumerated: every node of the document, with list items and the entries of name maps (dicts of many
keys, such as a weight map) collapsed to one representative each, gets each type in turn.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

# one value of each JSON type, and the nested shapes that break hashing / iteration assumptions
TYPE_VALUES = [None, True, 7, 2.5, "x", [["x"]], {"x": ["y"]}]


def _type_name(v) -> str:
    return type(v).__name__


def _is_name_map(d: dict) -> bool:
    """A dict keyed by names (tensor or file names, never identifiers): one entry stands for all."""
    return any(not k.isidentifier() for k in d)


def fields(doc, path: tuple = ()) -> Iterator[tuple]:
    """Every field path of ``doc`` (list items and name-map entries collapsed to their first one)."""
    if isinstance(doc, dict):
        items = list(doc.items())
        if _is_name_map(doc):
            items = items[:1]
        for k, v in items:
            yield path + (k,)
            yield from fields(v, path + (k,))
    elif isinstance(doc, list) and doc:
        yield path + (0,)
        yield from fields(doc[0], path + (0,))


def _set(doc, path: tuple, value):
    out = copy.deepcopy(doc)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


def type_mutations(doc) -> Iterator[tuple[str, tuple, object, object]]:
    """``(description, field path, new value, mutated document)`` for every field and every value of another type
    than its own (a list field also gets a list of lists, an object field an object of lists). The first one
    replaces the whole document by a list (path ``()``)."""
    yield "the whole document as a list", (), [doc], [doc]
    for path in fields(doc):
        node = doc
        for p in path:
            node = node[p]
        for v in TYPE_VALUES:
            if type(v) is type(node) and not isinstance(v, (list, dict)):
                continue
            if isinstance(v, dict) and isinstance(node, dict) and not _is_name_map(node):
                continue  # an object with other fields is not another type (missing fields are value fuzzing)
            if isinstance(v, list) and isinstance(node, list) and (not node or isinstance(node[0], list)):
                continue
            if {type(v), type(node)} == {int, float}:  # both JSON numbers
                continue
            yield f"{'.'.join(map(str, path))}: {_type_name(node)} -> {v!r}", path, v, _set(doc, path, v)
