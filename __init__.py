"""dspine-serve: lossless DSpine block speculative decoding.

Subpackages (each lives in a top-level folder of the repository):

- ``dspine.replica``  the engine of one GPU: models, pools, verification, scheduler
- ``dspine.kernels``  Triton kernels beside their pure-torch references
- ``dspine.protos``   gRPC schema and generated stubs
- ``dspine.cluster``  gRPC server, client SDK, CLI (and later the Ray Serve app)
"""

__version__ = "0.1.0"
