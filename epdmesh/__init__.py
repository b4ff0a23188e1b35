"""epdmesh: disaggregated encode / prefill / decode serving for multimodal LLMs."""

import os

# Our processes fork only to exec (the launcher starts every service with subprocess.Popen while its gRPC channel to
# the toggle is open). gRPC's fork handlers restart its poller thread in the forked child, where Popen's close_fds
# closes the poller's epoll fd before exec: the child aborted now and then (`epoll_wait ... Bad file descriptor`,
# "gateway exited with code -6 during start-up"; grpc/grpc#43055). They are not needed: off, before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
