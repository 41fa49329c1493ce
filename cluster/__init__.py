"""Cluster edge: gRPC server, client SDK, CLI. Nothing here does tensor math."""
