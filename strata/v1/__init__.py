"""The strata.v1 gRPC API: stubs generated from proto/strata/v1/*.proto by scripts/gen_proto.py (do not edit them).

    from strata.v1 import strata_pb2, strata_pb2_grpc     # public API (router)
    from strata.v1 import worker_pb2, worker_pb2_grpc     # router -> workers
    from strata.v1 import router_pb2, router_pb2_grpc     # workers -> router registry
    from strata.v1 import common_pb2                      # shared messages
"""
