"""Which parameters share a buffer, where each lives, and the buffer at run time (issue #53)."""
