"""Facts a rank of the scaling step records before it measures (guide section 5: confirm the GPU
topology, the process binding and the collective library): its CPU affinity and NUMA nodes, its
device's identity and PCI address, peer access between the node's devices, the collective loaded."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def cpu_ranges(cpus: set[int] | list[int]) -> str:
    """``{0,1,2,5}`` -> ``"0-2,5"`` (the kernel's cpulist notation)."""
    xs = sorted(cpus)
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes_of(cpus: set[int], sys_root: Path = Path("/sys/devices/system/node")) -> list[int] | None:
    """NUMA nodes whose CPUs this process may run on; None where /sys has no node folders."""
    nodes = []
    try:
        folders = sorted(sys_root.glob("node[0-9]*"))
    except OSError:
        return None
    if not folders:
        return None
    for folder in folders:
        try:
            node_cpus = parse_cpulist((folder / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if node_cpus & cpus:
            nodes.append(int(folder.name[4:]))
    return nodes


def binding_row(rank: int, local_rank: int, device: Any) -> dict[str, Any]:
    cpus = os.sched_getaffinity(0)
    row: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "hostname": socket.gethostname(),
                           "device": str(device), "cpu_affinity": cpu_ranges(cpus), "cpu_affinity_count": len(cpus),
                           "numa_nodes": numa_nodes_of(cpus)}
    if device.type == "cuda":
        import torch

        # Any: torch's stubs lack the pci_* fields its CUDA and ROCm builds have
        props: Any = torch.cuda.get_device_properties(device)
        row["device_name"] = props.name
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            row["device_uuid"] = str(uuid) if str(uuid).startswith("GPU-") or torch.version.hip else f"GPU-{uuid}"
        bdf = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        row["device_pci_bus_id"] = bdf
        try:
            node = int(Path(f"/sys/bus/pci/devices/{bdf}/numa_node").read_text())
            row["device_numa_node"] = node  # -1: the platform reports no affinity
        except (OSError, ValueError):
            pass
        for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
            if name in os.environ:
                row[name.lower()] = os.environ[name]
    return row


def local_topology(device: Any) -> dict[str, Any]:
    """Peer access between this node's rank devices, as torch sees it (rank 0's node)."""
    if device.type != "cuda":
        return {"skipped": "CPU ranks: no accelerator links between them"}
    import torch

    n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    matrix = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    return {"peer_access": matrix, "peer_access_source": "torch.cuda.can_device_access_peer between local ranks' devices",
            "devices": [torch.cuda.get_device_properties(i).name for i in range(n)]}


def collective_loaded(backend: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"backend_in_use": dist.get_backend()}
    if backend == "nccl":
        try:
            v = torch.cuda.nccl.version()
            out["version_loaded"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    return out
