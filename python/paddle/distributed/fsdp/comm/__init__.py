"""Who talks to whom (groups, layouts, expert parallel) and every collective (issue #53)."""
