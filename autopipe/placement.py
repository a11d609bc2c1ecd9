"""Plan a profile for the devices it will run on, as ``autopipe plan`` does, for the CLI and
the Python API alike.

A :class:`Placement` is a :class:`~autopipe.core.request.PlanRequest` with the devices the
flags resolved to (:func:`autopipe.device_target.resolve_devices`, once) and what lays them out
beyond one pipeline: data-parallel replicas of it, the all-reduce link, a shared host.
:func:`plan_on_devices` turns the devices into the request's ``Cluster``
(:func:`autopipe.device_target.cluster_for`) and plans a pipeline, its data-parallel replicas, or
the whole device mesh (``PlanRequest.plans_mesh``).

Typical use (what ``autopipe plan gpt.py --gpus 8 --device a100-80gb:4,v100-32gb:4`` does)::

    devices = resolve_devices("a100-80gb:4,v100-32gb:4")
    profile = profile_model_file("examples/gpt.py", devices, ProfileRequest(dtype="float16"))
    plan = plan_on_devices(profile, Placement(PlanRequest(gpus=8, checkpoint="auto"), devices))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopipe.core.catalog import get_device, is_catalog_device
from autopipe.core.cluster import Cluster
from autopipe.core.errors import UsageError
from autopipe.core.request import PlanRequest
from autopipe.device_target import cluster_for
from autopipe.planner import plan, scaling_report
from autopipe.planner.mesh import refuse_too_deep

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.core.profile import Profile
    from autopipe.device_target import DeviceTarget

__all__ = [
    "NEED_BANDWIDTH",
    "NEED_MESH_BANDWIDTH",
    "Placement",
    "device_count",
    "placed_cluster",
    "plan_on_devices",
    "scaling_rows",
]

NEED_BANDWIDTH = (
    "--data-parallel needs the gradient all-reduce bandwidth: pass --allreduce-bandwidth "
    "(e.g. 100GB/s in bytes or 800Gb/s in bits) or plan for a catalog --device"
)

NEED_MESH_BANDWIDTH = (
    "a mesh with tensor or data parallelism on measured devices needs the link inside a "
    "node for its TP collectives and DP reductions (else priced at 0 s): pass "
    "--allreduce-bandwidth (e.g. 100GB/s in bytes or 800Gb/s in bits) or plan for a "
    "catalog --device"
)


@dataclass(frozen=True)
class Placement:
    """What to plan and on which devices. Units: bytes, bytes per second."""

    request: PlanRequest
    """What to plan: ``gpus`` is every device (K, or K x D with ``replicas``, or N = PP x D
    x T for a mesh request); ``memory_per_device`` caps each device's memory."""
    devices: DeviceTarget | None = None
    """What the devices resolved to; None: the profile's own device (a saved profile)."""
    replicas: int | str | None = None
    """D data-parallel replicas of a K-stage pipeline (``gpus`` = K x D), or ``"auto"``;
    None: one pipeline. Planned as ``request.data_parallel`` with T = 1 and unsharded state
    (the one data-parallel route, the mesh search); for a mesh request D is
    ``request.data_parallel`` itself."""
    allreduce_bandwidth_bytes_per_s: float | None = None
    """The gradient all-reduce bandwidth per device (replicas), or the link inside a node
    (a mesh); None: the catalog device's link."""
    host_throughput: float | None = None
    """The K ranks share one host running at most this many of them at full speed at once
    (``Cluster.host_throughput``); None: dedicated devices."""


def placed_cluster(profile: Profile, placement: Placement) -> Cluster | None:
    """The devices ``placement`` plans ``profile`` for: the request's own ``cluster``, else
    the resolved devices' (:func:`autopipe.device_target.cluster_for`, memory capped by the
    request's ``memory_per_device``), with a shared host's throughput; None: equal devices
    named after the profile's. Raises ``ValueError`` (``DeviceSpecError``,
    ``CalibrationError``) for a device list the profile cannot be priced for."""
    request = placement.request
    cluster = request.cluster
    if cluster is None and request.gpus is not None:
        cluster = cluster_for(
            profile, request.gpus, placement.devices, memory_bytes=request.memory_per_device
        )
    shared = placement.host_throughput
    if shared is None:
        return cluster
    if cluster is None:
        return Cluster.homogeneous(
            device_count(request), profile.device, request.memory_per_device, host_throughput=shared
        )
    return dataclasses.replace(cluster, host_throughput=shared)


def device_count(request: PlanRequest) -> int:
    """Every device the request plans for: ``gpus``, else its cluster's devices (else 1)."""
    if request.gpus is not None:
        return request.gpus
    return len(request.cluster.devices) if request.cluster is not None else 1


def _memory(request: PlanRequest, cluster: Cluster | None) -> int | None:
    """The request's ``memory_per_device`` beside ``cluster``: none beside one built from the
    devices (it carries their memory, the cap folded in), as given otherwise."""
    built = cluster is not None and request.cluster is None
    return None if built else request.memory_per_device


def _with_cluster(request: PlanRequest, cluster: Cluster | None) -> PlanRequest:
    """``request`` planned on ``cluster``: one built from the devices carries their memory
    (the cap folded in), so ``gpus`` and ``memory_per_device`` give way to it."""
    if cluster is None:
        return request
    return dataclasses.replace(
        request, gpus=None, cluster=cluster, memory_per_device=_memory(request, cluster)
    )


def plan_on_devices(profile: Profile, placement: Placement) -> Plan:
    """The best plan for ``profile`` as ``placement`` asks: one pipeline, D replicas of one
    (``placement.replicas``), or the whole device mesh (``request.plans_mesh``). Raises
    ``PlanningError`` when nothing fits, ``RuleViolation`` for what torch would refuse,
    ``UsageError`` for devices that cannot be laid out as asked, ``ValueError`` for a device
    list the profile cannot be priced for."""
    placement = _replicas_as_mesh(placement)
    request = placement.request
    if request.plans_mesh:
        # no D (and T) lets the model fill N GPUs: refused before N devices are built
        refuse_too_deep(
            profile,
            device_count(request),
            profile.batch_size if request.batch_size is None else request.batch_size,
            tensor_parallel=request.tensor_parallel,
            data_parallel=request.data_parallel,
            gpus_per_node=request.gpus_per_node,
            context_parallel=request.context_parallel,
        )
    cluster = placed_cluster(profile, placement)
    if request.plans_mesh:
        return _plan_mesh(profile, placement, cluster)
    return plan(profile, _with_cluster(request, cluster))


def _replicas_as_mesh(placement: Placement) -> Placement:
    """``replicas`` (``--data-parallel`` alone) as the request's ``data_parallel``: one route
    for data parallelism, the mesh search with T = 1 and unsharded state, so the flag and
    ``PlanRequest(data_parallel=D)`` give the same plan. D = 1 is one pipeline."""
    if placement.replicas is None or placement.request.plans_mesh:
        return placement
    devices = placement.devices
    if devices is not None and devices.pipeline:
        raise UsageError("--data-parallel needs one kind of device; drop the NAME:COUNT list")
    request = dataclasses.replace(
        placement.request, data_parallel=placement.replicas, tensor_parallel=1, shard="none"
    )
    return dataclasses.replace(placement, request=request, replicas=None)


def _per_device(request: PlanRequest, cluster: Cluster | None) -> PlanRequest:
    """``request`` for a sweep that chooses the device count itself: no ``gpus`` or
    ``cluster``, the memory of one of the resolved devices."""
    return dataclasses.replace(
        request, gpus=None, cluster=None, memory_per_device=_memory(request, cluster)
    )


def scaling_rows(profile: Profile, placement: Placement) -> list[dict[str, Any]]:
    """``autopipe plan --scaling``: the request planned on K = 1 .. ``gpus`` equal devices
    (:func:`autopipe.planner.scaling_report`), one row per K."""
    cluster = placed_cluster(profile, placement)
    request = placement.request
    return scaling_report(
        profile,
        device_count(request),
        _per_device(request, cluster),
        device=cluster.devices[0] if cluster is not None else None,
    )


def _plan_mesh(profile: Profile, placement: Placement, cluster: Cluster | None) -> Plan:
    """``gpus`` devices as a PP x D x T mesh; what the request leaves ``auto`` is chosen.
    Nodes and their links from the counted device's platform unless the request says."""
    devices = placement.devices
    if devices is not None and devices.pipeline:
        raise UsageError("a mesh plan needs one kind of device; drop the NAME:COUNT list")
    request = placement.request
    gpus = device_count(request)
    spec = devices.counted_on if devices is not None else None
    if spec is None and profile.mode == "analytic" and is_catalog_device(profile.device):
        spec = get_device(profile.device)
    node = request.gpus_per_node or (spec.gpus_per_node if spec is not None else None)
    inter = request.inter_node_bandwidth_bytes_per_s
    if inter is None and spec is not None and spec.inter_node_bandwidth_bytes_per_s > 0:
        inter = spec.inter_node_bandwidth_bytes_per_s
    if node is not None and gpus > node and inter is None:
        where = (
            ""
            if spec is None
            else (
                f" (the catalog has no figure for {spec.name})"
                if is_catalog_device(spec.name)
                else f" ({spec.name}'s spec has no inter_node_bandwidth_bytes_per_s)"
            )
        )
        raise UsageError(
            f"--gpus {gpus} spans nodes of {node} but the inter-node bandwidth is not "
            f"known{where}: pass --inter-node-bandwidth (per device, e.g. 50GB/s or 400Gb/s)"
        )
    # A cluster from the devices carries their memory (the cap folded in); one made here
    # for the link alone leaves the request's memory_per_device as given.
    memory = _memory(request, cluster)
    link = placement.allreduce_bandwidth_bytes_per_s
    known = link is not None or (
        cluster is not None
        and all(d.link_bandwidth_bytes_per_s < float("inf") for d in cluster.devices)
    )
    if link is not None:  # the link inside a node (TP, and DP within it)
        if cluster is None:
            cluster = Cluster.homogeneous(gpus, profile.device, memory)
        cluster = Cluster(
            [dataclasses.replace(d, link_bandwidth_bytes_per_s=link) for d in cluster.devices]
        )
    request = dataclasses.replace(
        request,
        gpus=None if cluster is not None else gpus,
        cluster=cluster,
        memory_per_device=memory,
        gpus_per_node=node,
        inter_node_bandwidth_bytes_per_s=inter,
    )
    out = plan(profile, request)
    # Without a link figure collectives cost 0 s: a mesh that runs none (T = D = 1) is
    # priced right, and would win with them priced too; any other is refused.
    if not known and (out.tensor_parallel > 1 or out.data_parallel > 1):
        raise UsageError(NEED_MESH_BANDWIDTH)
    return out
