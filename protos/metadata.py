"""Wire contract beyond the .proto: the gRPC metadata keys both ends use.

Here (not in the server's or the SDK's modules) so that each end imports the key
without importing the other end: the SDK stays free of the engine and torch.
"""

FIELD_METADATA_KEY = "dspine-field"
"""Trailing-metadata key of an INVALID_ARGUMENT / FAILED_PRECONDITION answer: the request field it names."""
