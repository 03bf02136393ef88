"""The side streams that a layer's independent chains of small kernels run on (CUDA only).

A few streams per device (`which`), shared by every layer: a branch forks from the current
stream (`side.wait_stream(main)`) and joins it again (`main.wait_stream(side)`) inside the same
layer, so a CUDA graph captures them as parallel branches. Tensors a branch allocates are freed
into its stream's pool; its next user (a later branch) first waits for the main stream.
"""

from __future__ import annotations

import contextlib

import torch

_SIDE: dict[tuple[torch.device, int, bool], torch.cuda.Stream] = {}
#: the priority of an urgent side stream (lower is higher; CUDA clamps it to the device's range)
URGENT_PRIORITY = -5


def side_stream(device: torch.device, which: int = 0, urgent: bool = False) -> torch.cuda.Stream | None:
    """The device's side stream number `which` (0, or 1 for a second branch beside the first), or
    None off CUDA (the branch then runs in order). urgent: a stream of its own at high priority,
    whose ready blocks the GPU schedules before those of the main stream's kernels (a CUDA graph
    keeps the priority of each captured kernel)."""
    if device.type != "cuda":
        return None
    key = (device, which, urgent)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device, priority=URGENT_PRIORITY if urgent else 0)
    return _SIDE[key]


def on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Run the enclosed launches on `stream` (None: where they are)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
