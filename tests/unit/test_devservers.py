import socket

from strata.devservers import LOOPBACK, free_port_with_bus


def test_port_with_bus_is_low_enough_for_redis_cluster_and_both_ports_bind():
    for _ in range(20):
        port = free_port_with_bus()
        assert port <= 55_535  # redis-server --cluster-enabled refuses a client port above this
        for p in (port, port + 10_000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((LOOPBACK, p))
