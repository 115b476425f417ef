"""What the prefill and decode workers share: the engine thread, the KV bridge between `engine` and `kvstore`
(DESIGN §1: a worker wires them together), worker-side text streaming, proto conversion and the gRPC server shell.
"""
