"""Generated protobuf and gRPC modules (phalanx.api.v1), built from proto/ by tools/genproto.py."""
