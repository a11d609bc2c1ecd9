"""``autopipe plan``: profile a model (or read a profile) and print the best pipeline plan."""

from __future__ import annotations

import argparse
import warnings
from typing import TYPE_CHECKING, Any

from autopipe.cli import common
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import DEFAULT_CHECKPOINT, PLAN_SCHEDULES, SHARD_MODES
from autopipe.planner.emit import EMIT_FORMATS, EmitError, emit

if TYPE_CHECKING:
    from autopipe.core.cluster import Cluster
    from autopipe.core.plan import Plan
    from autopipe.core.profile import Profile
    from autopipe.devices import DeviceTarget

EPILOG = (
    "examples:\n  autopipe plan examples/gpt.py --gpus 8 --json plan.json\n"
    "  autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb\n"
    "  autopipe plan profile.json --gpus 4 --memory 16GiB\n"
    "  autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb:4,v100-32gb:4 --dtype float16"
)

NEED_BANDWIDTH = (
    "--data-parallel needs the gradient all-reduce bandwidth: pass --allreduce-bandwidth "
    "(bytes/s, e.g. 100GB) or plan for a catalog --device"
)


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe plan MODEL.py|PROFILE.json --gpus K ...`` to the CLI's subparsers."""
    p = sub.add_parser(
        "plan",
        help="profile a model (or read a profile) and print the best pipeline plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Cut a model into K pipeline stages, choose micro-batches and re-materialization.",
        epilog=EPILOG,
    )
    p.add_argument("model", help="MODEL.py[:FACTORY] or a saved PROFILE.json")
    p.add_argument(
        "--gpus",
        type=common.positive_int,
        required=True,
        help="number of pipeline stages K; with --data-parallel or the mesh flags "
        "(--tensor-parallel, --shard) all the GPUs, N = PP x D x T",
    )
    p.add_argument(
        "--microbatches", type=common.microbatches, default="auto", help="M, or 'auto' (default)"
    )
    p.add_argument(
        "--memory",
        type=common.byte_size,
        help="memory per device, e.g. 80GiB (default: unlimited, or the catalog device's)",
    )
    p.add_argument(
        "--checkpoint",
        choices=["never", "auto", "always", "except_last"],
        default=DEFAULT_CHECKPOINT,
        help="re-materialization (default: auto, only where memory needs it)",
    )
    p.add_argument(
        "--schedule",
        choices=[*PLAN_SCHEDULES, "auto"],
        default="gpipe",
        help="pipeline schedule (torch.distributed.pipelining's); auto chooses the schedule, "
        "virtual stages, M and checkpointing together (default: gpipe)",
    )
    p.add_argument(
        "--virtual-stages",
        type=common.microbatches,
        default="auto",
        metavar="V|auto",
        help="model chunks per GPU: 1 for gpipe/1f1b, 2 for zbv/dualpipev, 1-4 for the looped "
        "schedules (default: auto)",
    )
    p.add_argument(
        "--strategy",
        choices=["dp", "ilp", "uniform", "parameters", "greedy-time"],
        default="dp",
        help="how the cut is chosen: dp (default: the exact dynamic program), ilp (the same "
        "optimum from an integer program, a cross-check), or a baseline to compare "
        "with: uniform (equal unit counts, torch pipelining / Megatron), parameters (balanced "
        "parameter counts, DeepSpeed), greedy-time (balanced measured time, torchgpipe)",
    )
    common.json_option(p, "write the plan as JSON to PATH (stdout if no PATH)")
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="write five figures to DIR: timeline.png, memory.png, bubble.png, balance.png, "
        "scaling.png",
    )
    p.add_argument("--save-profile", metavar="PATH", help="also save the profile as JSON")
    p.add_argument(
        "--emit",
        choices=EMIT_FORMATS,
        metavar="FORMAT",
        help="also hand the plan to another framework in its own words: torch (split_spec "
        "JSON), torchtitan ([parallelism] TOML) or megatron (layout and flags)",
    )
    p.add_argument(
        "--emit-out", metavar="PATH", help="write --emit's output to PATH (default: stdout)"
    )
    p.add_argument(
        "--data-parallel",
        metavar="auto|D",
        type=common.microbatches,
        help="use --gpus devices as K stages x D data-parallel replicas; 'auto' picks D",
    )
    p.add_argument(
        "--tensor-parallel",
        metavar="auto|T",
        type=common.microbatches,
        help="plan the whole device mesh: --gpus N = PP x D x T, each stage split over T "
        "devices of one node by the model's TP plan (Hugging Face's, or the model file's "
        "tp_plan()); auto tries every T dividing the heads and the node",
    )
    p.add_argument(
        "--shard",
        choices=[*SHARD_MODES, "auto"],
        help="shard the training state over the D replicas: optimizer (ZeRO-1), gradients "
        "(ZeRO-2) or parameters (ZeRO-3, FSDP2); plans the whole mesh (default there: auto)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=common.positive_int,
        metavar="N",
        help="devices per node for the mesh (default: 8 for catalog GPUs, else all in one)",
    )
    p.add_argument(
        "--inter-node-bandwidth",
        type=common.byte_size,
        metavar="BYTES_PER_S",
        help="per-device bandwidth between nodes for the mesh, e.g. 50GB (default: the "
        "catalog's, e.g. 400 Gb/s InfiniBand NDR per H100)",
    )
    p.add_argument(
        "--host-throughput",
        # Below 1/1000 of one device a step would take 1000 x its measured time per rank.
        type=common.positive_float(
            "a number of devices' worth of compute > 0, e.g. 1.8", at_least=1e-3
        ),
        metavar="N",
        help="the K ranks share one host that runs at most N of them at full speed at once "
        "(ranks that are processes on one machine's CPU cores; measure it as K x one "
        "process's step alone over its step while all K run it). Default: dedicated devices",
    )
    p.add_argument(
        "--allreduce-bandwidth",
        type=common.byte_size,
        metavar="BYTES_PER_S",
        help="gradient all-reduce bandwidth per device for --data-parallel, e.g. 100GB "
        "(default: the catalog device's link); with the mesh flags, the link inside a node",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="also plan K = 1..--gpus and print throughput and memory per K (and the fewest GPUs that fit)",
    )
    common.model_options(p)
    common.add_common_flags(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    common.check_output_path(args.json, "--json", inputs=[args.model])
    common.check_output_path(args.save_profile, "--save-profile", inputs=[args.model])
    common.check_output_path(args.plot, "--plot", directory=True)
    common.check_output_path(args.emit_out, "--emit-out", inputs=[args.model])
    if args.emit_out and not args.emit:
        raise common.UsageError("--emit-out names where --emit FORMAT goes: give --emit too")
    common.check_distinct_outputs(
        (args.json, "--json"),
        (args.save_profile, "--save-profile"),
        (args.emit_out, "--emit-out"),
        (args.plot, "--plot"),  # a folder named like a file would block that file's write
    )
    mesh = _plans_mesh(args)
    if mesh and args.scaling:
        raise common.UsageError(
            "--scaling sweeps pipelines on K GPUs; drop it when planning the mesh "
            "(--tensor-parallel, --shard, --gpus-per-node, --inter-node-bandwidth)"
        )
    if mesh and args.host_throughput is not None:
        raise common.UsageError(
            "--host-throughput prices one pipeline's ranks on one host; drop it when "
            "planning the mesh"
        )
    node = args.gpus_per_node or _catalog_node_size(args.device)
    if node is not None and isinstance(args.tensor_parallel, int) and node % args.tensor_parallel:
        raise common.UsageError(
            f"--tensor-parallel {args.tensor_parallel} does not divide the {node} GPUs per node: "
            "a TP group never spans nodes; give a divisor (or --gpus-per-node)"
        )
    if isinstance(args.tensor_parallel, int) and args.gpus % args.tensor_parallel:
        raise common.UsageError(
            f"--tensor-parallel {args.tensor_parallel} does not divide --gpus {args.gpus}: "
            "the GPUs are PP x D x T; give a divisor of --gpus or auto"
        )
    for flag in ("data_parallel", "scaling"):  # before spending time profiling
        if args.host_throughput is not None and getattr(args, flag):
            raise common.UsageError(
                f"--host-throughput cannot be combined with --{flag.replace('_', '-')}: it "
                "prices one pipeline's K ranks on one host; drop one of the two"
            )
    listed = sum(n for _, n in common.device_list_counts(args.device) or [])
    if listed and listed != args.gpus:
        raise common.UsageError(
            f"--device {args.device} lists {listed} devices but --gpus is {args.gpus}"
        )
    if (
        args.data_parallel
        and not mesh
        and args.allreduce_bandwidth is None
        and not (args.device or args.device_spec or args.model.endswith(".json"))
    ):
        raise common.UsageError(NEED_BANDWIDTH)  # say so before spending time profiling
    if isinstance(args.data_parallel, int) and args.gpus % args.data_parallel:
        raise common.UsageError(
            f"--data-parallel {args.data_parallel} does not divide --gpus {args.gpus}: the "
            "GPUs are K stages x D replicas; give a divisor of --gpus or auto"
        )
    if args.batch_size:
        _check_replicas(args, args.batch_size)  # before spending time profiling
    _check_schedule_rules(args)  # before spending time profiling
    profile, target = common.load_profile_or_model(args)
    from autopipe.planner import PlanningError, RuleViolation, plan

    if args.gpus > len(profile.units) and not args.data_parallel and not mesh:
        raise common.UsageError(
            f"--gpus {args.gpus} is more than the model's {len(profile.units)} units; use at most "
            f"{len(profile.units)} or a finer --granularity (module or node)"
        )
    batch = args.batch_size or profile.batch_size
    _check_replicas(args, batch)
    m = args.microbatches
    if isinstance(m, int) and batch % m:  # bad input (the planner would call it a failure)
        from autopipe.planner.search import divisor_hint

        raise common.UsageError(
            f"--microbatches {m} does not divide the batch size {batch}; " + divisor_hint(batch, m)
        )
    cluster = _cluster(profile, args, target)
    # With a cluster, its devices give K and the memory (--memory already folded in).
    gpus, memory = (None, None) if cluster is not None else (args.gpus, args.memory)
    options = {
        "batch_size": args.batch_size,
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "virtual_stages": args.virtual_stages,
        "checkpoint": args.checkpoint,
        "strategy": args.strategy,
        "optimizer": args.optimizer or "auto",
        "bytes_per_parameter": args.bytes_per_parameter,
    }
    try:
        if mesh:
            result = _plan_mesh(profile, args, target, cluster, memory, options)
        elif args.data_parallel:
            result = _plan_data_parallel(profile, args, cluster, memory, options)
        else:
            result = plan(
                profile,
                PlanRequest(gpus=gpus, memory_per_device=memory, cluster=cluster, **options),
            )
    except RuleViolation as exc:  # a schedule, V or M torch would refuse: bad input
        raise common.UsageError(str(exc)) from exc
    except PlanningError as exc:
        raise common.Failure(str(exc)) from exc
    except ValueError as exc:
        raise common.UsageError(str(exc)) from exc
    from autopipe.report import format_plan, format_scaling

    common.say(args, format_plan(result))
    if args.scaling:
        from autopipe.planner import scaling_report

        rows = scaling_report(
            profile,
            args.gpus,
            PlanRequest(memory_per_device=memory, **options),
            device=cluster.devices[0] if cluster is not None else None,
        )
        result.meta["scaling"] = rows  # a note for people: nothing reads it back
        common.say(args, "\n" + format_scaling(rows))
    emitted = None
    if args.emit:
        try:  # before any file is written: a format that cannot say the plan writes nothing
            emitted = emit(result, args.emit)
        except EmitError as exc:
            raise common.UsageError(f"--emit {args.emit}: {exc}") from exc
    if args.save_profile:  # only once the request is accepted: a refusal writes nothing
        profile.save(args.save_profile)
    if args.plot:
        from autopipe.viz import collect_plot_data, plot_all, too_many_tasks

        too_many = too_many_tasks(result)
        if too_many is not None:  # the plan itself is fine: keep it, skip only the plots
            warnings.warn(f"--plot skipped: {too_many}", stacklevel=1)
        else:
            data = collect_plot_data(result, profile)
            paths = plot_all(result, args.plot, plot_data=data, progress=not args.quiet)
            # Kept in the plan written below, so `autopipe plot PLAN.json` redraws all five.
            result.plot_data = data
            common.say(args, "plots: " + ", ".join(str(p) for p in paths))
    # The profile travels with the plan: `autopipe plot` and tools can re-plan from it.
    if result.profile is None:
        result.profile = profile
    common.emit_json(result.to_dict(), args.json)
    if emitted is not None:
        common.emit_text(emitted, args.emit_out)
        if args.emit_out and args.emit_out != "-":  # `-` is stdout
            common.say(args, f"{args.emit} config written to {args.emit_out}")
    if args.json and args.json != "-":
        common.say(args, f"plan written to {args.json}")
    return common.EXIT_OK


def _check_schedule_rules(args: argparse.Namespace) -> None:
    """Refuse a forced ``--schedule`` (with ``--virtual-stages`` / ``--microbatches``) that
    torch would refuse, on the request alone: the pre-flight rules that need no profile
    (``autopipe.planner.preflight.violations``). The batch rules wait for the profile. O(1)."""
    if args.schedule == "auto":
        return
    from autopipe.planner.preflight import violations
    from autopipe.planner.schedules import V_SHAPE_SCHEDULES, check_virtual_stages

    v = args.virtual_stages
    if isinstance(v, int):
        why = check_virtual_stages(args.schedule, v)
        if why is not None:
            raise common.UsageError(f"stages-per-rank: {why}")
    else:
        v = 2 if args.schedule in V_SHAPE_SCHEDULES else 1
    m = args.microbatches
    if not isinstance(m, int) or args.data_parallel or _plans_mesh(args):
        return  # M is chosen later; with --data-parallel K is too
    # batch = M passes the batch rules: they wait for the profile's batch (and its hint).
    problems = violations(args.schedule, args.gpus, v, m, m)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise common.UsageError(problems[0] + more)


def _cluster(
    profile: Profile, args: argparse.Namespace, target: DeviceTarget | None
) -> Cluster | None:
    """The devices to plan for (``autopipe.devices.cluster_for``): a ``--device`` list, the
    catalog device an analytic profile was counted on, or None for a measured profile."""
    from autopipe.devices import cluster_for

    if target is None and common.device_list_counts(args.device):
        target = common.resolve_device_flags(args)  # a saved profile planned for a list
    try:
        cluster = cluster_for(profile, args.gpus, target, memory_bytes=args.memory)
    except ValueError as exc:  # a list the profile cannot be priced for
        raise common.UsageError(str(exc)) from exc
    shared = args.host_throughput
    if shared is None:
        return cluster
    import dataclasses

    from autopipe.core.cluster import Cluster

    if cluster is None:
        return Cluster.homogeneous(args.gpus, profile.device, args.memory, host_throughput=shared)
    return dataclasses.replace(cluster, host_throughput=shared)


def _check_replicas(args: argparse.Namespace, batch: int) -> None:
    """``--data-parallel D`` must divide the global batch: one line naming the D that do."""
    if not isinstance(args.data_parallel, int):
        return
    from autopipe.planner import PlanningError
    from autopipe.planner.data_parallel import check_replicas_divide_batch

    try:
        check_replicas_divide_batch(args.data_parallel, args.gpus, batch)
    except PlanningError as exc:
        raise common.UsageError(f"--data-parallel {args.data_parallel}: {exc}") from exc


def _plan_data_parallel(
    profile: Profile,
    args: argparse.Namespace,
    cluster: Cluster | None,
    memory: int | None,
    options: dict[str, Any],
) -> Plan:
    """``--data-parallel auto|D``: ``--gpus`` devices as K stages x D replicas."""
    from autopipe.planner import plan_data_parallel

    if common.device_list_counts(args.device):
        raise common.UsageError(
            "--data-parallel needs one kind of device; drop the NAME:COUNT list"
        )
    device = cluster.devices[0] if cluster is not None else None
    bandwidth = args.allreduce_bandwidth
    if (
        bandwidth is None
        and device is not None
        and device.link_bandwidth_bytes_per_s < float("inf")
    ):
        bandwidth = device.link_bandwidth_bytes_per_s
    if bandwidth is None:
        raise common.UsageError(NEED_BANDWIDTH)
    return plan_data_parallel(
        profile,
        args.gpus,
        PlanRequest(memory_per_device=memory, **options),
        replicas=args.data_parallel,
        allreduce_bandwidth_bytes_per_s=bandwidth,
        device=device,
    )


def _plans_mesh(args: argparse.Namespace) -> bool:
    """Whether the flags ask for the whole device mesh rather than a K-stage pipeline (or
    the K x D layout of ``--data-parallel`` alone)."""
    return any(
        getattr(args, flag) is not None
        for flag in ("tensor_parallel", "shard", "gpus_per_node", "inter_node_bandwidth")
    )


def _plan_mesh(
    profile: Profile,
    args: argparse.Namespace,
    target: DeviceTarget | None,
    cluster: Cluster | None,
    memory: int | None,
    options: dict[str, Any],
) -> Plan:
    """``--tensor-parallel`` / ``--shard`` ...: ``--gpus`` devices as a PP x D x T mesh; what is
    not given is chosen (``auto``). Nodes and their links from the catalog device's platform
    unless the flags say."""
    from autopipe.core.catalog import get_device, is_catalog_device
    from autopipe.planner import plan

    if common.device_list_counts(args.device):
        raise common.UsageError("a mesh plan needs one kind of device; drop the NAME:COUNT list")
    spec = target.counted_on if target is not None else None
    if spec is None and profile.mode == "analytic" and is_catalog_device(profile.device):
        spec = get_device(profile.device)
    node = args.gpus_per_node or (spec.gpus_per_node if spec is not None else None)
    inter = args.inter_node_bandwidth
    if inter is None and spec is not None and spec.inter_node_bandwidth_bytes_per_s > 0:
        inter = spec.inter_node_bandwidth_bytes_per_s
    if node is not None and args.gpus > node and inter is None:
        where = f"the catalog has no figure for {spec.name}" if spec is not None else "unknown"
        raise common.UsageError(
            f"--gpus {args.gpus} spans nodes of {node} but the inter-node bandwidth is "
            f"{where}: pass --inter-node-bandwidth (bytes/s per device, e.g. 50GB)"
        )
    if args.allreduce_bandwidth is not None:  # the link inside a node (TP, and DP within it)
        import dataclasses

        from autopipe.core.cluster import Cluster as _Cluster

        if cluster is None:
            cluster = _Cluster.homogeneous(args.gpus, profile.device, memory)
        cluster = _Cluster(
            [
                dataclasses.replace(d, link_bandwidth_bytes_per_s=args.allreduce_bandwidth)
                for d in cluster.devices
            ]
        )
    gpus = None if cluster is not None else args.gpus
    return plan(
        profile,
        PlanRequest(
            gpus=gpus,
            cluster=cluster,
            memory_per_device=memory,
            tensor_parallel=args.tensor_parallel or "auto",
            data_parallel=args.data_parallel or "auto",
            shard=args.shard or "auto",
            gpus_per_node=node,
            inter_node_bandwidth_bytes_per_s=inter,
            **options,
        ),
    )


def _catalog_node_size(device: str | None) -> int | None:
    """GPUs per node of the catalog device ``--device`` names (before any profiling), or None."""
    from autopipe.core.catalog import get_device, is_catalog_device

    if not device or common.device_list_counts(device) or not is_catalog_device(device):
        return None
    return get_device(device).gpus_per_node
