"""The committed stubs are what protoc makes of the committed .proto files."""

from epdmesh import protogen


def test_committed_stubs_are_current(tmp_path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc wrote nothing"
    for path in fresh:
        committed = protogen.ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing; run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale; run `make proto`"


def test_stubs_describe_every_stage_rpc():
    from epdmesh.v1 import mesh_pb2

    services = {s.name: [m.name for m in s.methods] for s in mesh_pb2.DESCRIPTOR.services_by_name.values()}
    assert services["Encoder"] == ["Encode", "AwaitEncode"]
    assert services["Prefiller"] == ["Prefill"]
    assert services["Decoder"] == ["Decode"]
    assert mesh_pb2.DESCRIPTOR.services_by_name["Decoder"].methods_by_name["Decode"].server_streaming
    assert set(services["Toggle"]) >= {"Route", "Register", "Heartbeat"}
    assert mesh_pb2.DESCRIPTOR.package == "epdmesh.v1"
