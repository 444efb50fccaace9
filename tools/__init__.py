"""The operator's and developer's tools: the `nodecomm` command (cli), the benches it runs, and
what they print. Not imported by ranks or the daemon."""
