"""Moving pages between workers: a stage returns a handle on pages it keeps under a lease;
the next stage pulls them through a backend and acks; the source frees them on ack or expiry.

Life of a page set:
  1. the source stage finishes → `LeaseTable.grant` → `PageHandle` (worker, kind, block ids, layout, expiry).
  2. the handle travels (in gRPC messages, via the gateway) to the next stage's worker.
  3. that worker's `PagePuller.pull(handle)` reads the bytes from the source, then `release(handle)` acks.
  4. the source frees the blocks on the ack, or when `LeaseTable.expired` reports the lease (puller died).
"""

from common.transfer.handle import PageHandle
from common.transfer.leases import Lease, LeaseTable
from common.transfer.puller import PagePuller, PullFailed

__all__ = ["Lease", "LeaseTable", "PageHandle", "PagePuller", "PullFailed"]
