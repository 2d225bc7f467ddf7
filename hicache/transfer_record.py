"""One transfer between L1 and L2 as the engine and the cost model see it (hicache/transfer.py
enqueues them and awaits `Transfer.complete` on a waiter thread): its buffers, its CUDA events, and the time it took, split into what is
its own cost (enqueue, waiting behind other transfers, the copy) and what is not (a one-time
workspace allocation; the wait for work already on the caller's stream; on CUDA, how late a thread
saw it complete)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hicache.workspaces import Workspace


class TransferError(RuntimeError):
    """kind: the failure's reason as `metrics.failures` counts it ("closed": the engine was closed)."""

    def __init__(self, message: str, kind: str = "transfer") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(eq=False)
class Transfer:
    direction: str
    num_pages: int
    num_bytes: int
    enqueue_ns: int
    setup_ns: int
    started_ns: int
    event: object = None                # torch.cuda.Event or None when already complete
    start_event: object = None
    # at enqueue: `enqueued_event` on an idle stream (fires then), `ready_event` on the caller's
    # stream (fires once the work before it there is done: a forward in flight, which is waited for
    # whether a prefix is restored or recomputed, so not the transfer's cost)
    enqueued_event: object = None
    ready_event: object = None
    compute_wait_ns: int = 0            # between the two (CUDA, set at completion)
    device_ns: int = 0                  # CUDA: from `enqueued_event` to the end, on the device clock
    finish_ns: int = 0                  # running `finish` after the device was done
    finish: object = None               # callable run after completion (CPU index copy), off-loop
    workspace: Workspace | None = None
    keepalive: list = field(default_factory=list)
    page_list: object = None            # a copy kernel's pinned page list (PageLists), until it settles
    fail: bool = False                  # completion raises TransferError: not enqueued (`error`), or an injected fault
    done_ns: int = 0
    service_ns: int = 0
    epoch: int = 0                      # h2d_layerwise on CUDA: the value its layer flags reach
    error: str | None = None            # why `fail` (default: an injected failure)
    fail_kind: str = "transfer"         # TransferError.kind of that failure
    synchronous: bool = False           # the CPU: copied inside the enqueue (its enqueue_ns)

    @property
    def end_to_end_ns(self) -> int:
        return self.done_ns - self.started_ns

    @property
    def queue_wait_ns(self) -> int:
        """Waiting behind other work on its streams (CUDA: on the device clock), and, without the
        device clock, for the completion to be seen (a copy done inside its enqueue: its service holds
        that enqueue, counted once; regression: taken off twice)."""
        if self.device_ns:
            return max(0, self.device_ns - self.compute_wait_ns - self.service_ns)
        enqueue_ns = 0 if self.synchronous else self.enqueue_ns
        return max(0, self.end_to_end_ns - enqueue_ns - self.setup_ns - self.compute_wait_ns - self.service_ns)

    @property
    def seen_wait_ns(self) -> int:
        """CUDA: from the device finishing the transfer to a thread seeing it (and running `finish`),
        less that finish: a loop or a GIL busy elsewhere, not the copy."""
        if not self.device_ns:
            return 0
        return max(0, self.end_to_end_ns - self.setup_ns - self.device_ns - self.finish_ns)

    @property
    def recurring_ns(self) -> int:
        """What the transfer itself costs each time (the cost model's sample), less a one-time setup
        and the wait for the caller's stream. CUDA: its enqueue or its time on the device, whichever
        is longer, plus `finish`; when a thread saw it done is left out (regression: a busy trace
        replay's restores were seen ~100 ms after their copies ended, and the model learned H2D at
        3.9 GiB/s; docs/benchmarks.md, session 17). Copied inside the enqueue (the CPU): that and
        `finish` (regression: a CPU restore overlapped with its tail forward was completed after the
        forward, and the model learned the forward as the copy). Elsewhere: end to end."""
        if self.synchronous:
            return self.enqueue_ns + self.finish_ns
        if self.device_ns:
            return max(self.enqueue_ns, self.device_ns - self.compute_wait_ns) + self.finish_ns
        return max(0, self.end_to_end_ns - self.setup_ns - self.compute_wait_ns)

    def complete(self, poll: bool = False) -> None:
        """Block until the copy is done (on a waiter thread: `Event.synchronize` releases the GIL),
        run `finish`, and fill in the timings. poll: query the event until it is done instead of
        sleeping in its synchronize (the caller's thread stays on the CPU: see EngineConfig.gpu_wait)."""
        if self.event is not None:
            while poll and not self.event.query():
                time.sleep(0)  # lets other threads take the GIL
            self.event.synchronize()
            self.service_ns = int(self.start_event.elapsed_time(self.event) * 1e6)
            if self.enqueued_event is not None:  # (every CUDA path records both at enqueue)
                self.device_ns = max(1, int(self.enqueued_event.elapsed_time(self.event) * 1e6))
                self.compute_wait_ns = max(0, int(self.enqueued_event.elapsed_time(self.ready_event) * 1e6))
        if self.finish is not None:
            t0 = time.monotonic_ns()
            self.finish()
            self.finish_ns = time.monotonic_ns() - t0
        self.done_ns = time.monotonic_ns()
        if self.service_ns == 0:
            self.service_ns = (self.enqueue_ns + self.finish_ns if self.synchronous
                               else self.done_ns - self.started_ns - self.setup_ns)
        self.compute_wait_ns = min(self.compute_wait_ns, max(0, self.end_to_end_ns - self.setup_ns - self.enqueue_ns))
