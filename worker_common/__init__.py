"""What the prefill and decode workers share: the engine thread, the KV bridge between `engine` and `kvstore`
(DESIGN §1: a worker wires them together), worker-side text streaming, proto conversion, the gRPC server shell, and
the worker's side of the router (DESIGN §6, §9): KV events (`kv_events`), load and cache stats (`load`,
`cache_stats`), cache admin (`cache_admin`, `demotion`) and registration with the router's Registry
(`registration`).
"""
