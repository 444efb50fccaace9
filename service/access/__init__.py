"""Who may call the daemon and how much: its sockets, each caller's identity, per-caller quotas and rates."""
