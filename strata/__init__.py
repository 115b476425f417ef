"""Strata's shell: the `strata` CLI, client, configuration, launchers and the generated `strata.v1` stubs."""
import os

# NOTE: launchers start their children with fork() (a preexec_fn makes them die with the launcher). With gRPC's fork
# support on (grpcio's default), a process that has used gRPC restarts gRPC's poller in the forked child, which then
# finds its epoll fd closed by close_fds and aborts before exec (the child "exits with -6"; 1 in 200 spawns measured
# here). The flag is read when grpc initializes, so it is set here, before any module of ours can import grpc: a
# program that used a StrataClient and then starts a cluster (tests, benchmarks) would otherwise fork with it on.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
