"""The committed stubs match dspine.proto and import as a package."""

from __future__ import annotations

import pytest


def test_stubs_up_to_date():
    pytest.importorskip("grpc_tools")
    from dspine.protos import generate

    assert generate.stale_files() == [], "run: python -m dspine.protos.generate"


def test_stubs_import_inside_the_package():
    from dspine.protos.dspine.v1 import dspine_pb2, dspine_pb2_grpc

    assert dspine_pb2_grpc.DSpineStub is not None
    assert dspine_pb2.DESCRIPTOR.package == "dspine.v1"
    assert set(dspine_pb2.DESCRIPTOR.services_by_name["DSpine"].methods_by_name) == {
        "Generate", "GenerateStream", "Tokenize", "Detokenize", "GetModelInfo"}
