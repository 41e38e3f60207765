"""Where bytes live and how they cross host <-> device (issue #53; docs/internals.md has the map)."""
