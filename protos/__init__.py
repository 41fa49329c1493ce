"""gRPC schema (dspine/v1/*.proto) and generated stubs."""
