"""tandem.launch: the loopback ports the tests and benchmarks start services on."""
from tandem.launch import ServiceProcess, free_port


def test_free_port_never_hands_out_the_same_port_twice():
    # bind(0) after a close may offer the port again; a service's gRPC and metrics ports once collided
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


def test_a_service_gets_distinct_ports():
    services = [ServiceProcess("draft_service") for _ in range(200)]
    ports = [port for s in services for port in (s.port, s.metrics_port)]
    assert len(set(ports)) == len(ports)
