"""The service path: collectives the daemon itself runs on memory its ranks submit."""
