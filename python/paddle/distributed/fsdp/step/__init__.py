"""When things happen in a training step, and the two stock-paddle wrappers (issue #53)."""
