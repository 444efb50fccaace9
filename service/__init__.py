"""The nodecomm daemon (nodecommd)."""
