"""Generated protobuf/gRPC stubs of proto/epdmesh/v1 (import path = proto package). Do not edit; `make proto`."""
