"""The stage calls a `StageCalls` stream carries: a call's body → (the unary rpc it stands for, its reply's body)."""

METHODS = {
    "encode": ("/epdmesh.v1.Encoder/Encode", "encode"),
    "await_encode": ("/epdmesh.v1.Encoder/AwaitEncode", "encode"),
    "prefill": ("/epdmesh.v1.Prefiller/Prefill", "prefill"),
}


def span_attributes(method: str) -> dict[str, str]:
    """What OpenTelemetry's gRPC instrumentation puts on the unary rpc's span, and that the call rode a stream."""
    service, name = method.lstrip("/").split("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "epdmesh.stage_call": "stream"}
