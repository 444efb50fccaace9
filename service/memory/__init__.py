"""Group memory: what the daemon allocates for a group and how it reaches the ranks (descriptor passing)."""
