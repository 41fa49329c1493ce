"""Cluster edge: the Ray Serve application (config, ingress, admission, replica deployment, router), the
standalone gRPC server, tracing and metrics, the client SDK and the CLI. Nothing here does tensor math."""
