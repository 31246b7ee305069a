"""Point-to-point messages between trusted ranks: JSON in uint8 tensors, never pickle.

torch.distributed's `send_object_list` unpickles what arrives; a decode instance must not
run code because a peer said so. Control messages are JSON (a length, then the bytes);
KV blocks travel as plain tensors whose shape and dtype the receiver already knows.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def send_json(obj: Any, dst: int, group: dist.ProcessGroup | None = None) -> int:
    """Send a JSON-able value to rank `dst`; returns the bytes sent."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group)
    dist.send(payload, dst, group=group)
    return payload.numel()


def recv_json(src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Receive what `send_json` sent from rank `src`."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)  # [num_bytes]
    dist.recv(payload, src, group=group)
    return json.loads(bytes(payload.tolist()).decode())


def recv_command(src: int, group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """The next command from rank `src`; None once it says {"stop": true} or is gone."""
    try:
        command = recv_json(src, group)
    except (RuntimeError, dist.DistError):
        return None  # its socket closed: nobody is left to serve
    return None if command["stop"] else command
