"""``autopipe plan``: profile a model (or read a profile) and print the best pipeline plan."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from typing import TYPE_CHECKING

from autopipe import profiling
from autopipe.cli import common
from autopipe.core.optimizer import GRAD_CLIPS, OPTIMIZER_KERNELS
from autopipe.core.plantext import format_plan
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import violations
from autopipe.core.vocabulary import (
    DEFAULT_CHECKPOINT,
    PLAN_SCHEDULES,
    PRECISIONS,
    SHARD_MODES,
    V_SHAPE_SCHEDULES,
)
from autopipe.device_target import profiled_on
from autopipe.placement import (
    NEED_BANDWIDTH,
    NEED_MESH_BANDWIDTH,
    Placement,
    plan_on_devices,
    scaling_rows,
)
from autopipe.planner import PlanningError, RuleViolation
from autopipe.planner.data_parallel import check_replicas_divide_batch
from autopipe.planner.emit import EMIT_FORMATS, EmitError, emit
from autopipe.planner.search import divisor_hint
from autopipe.planner.trainer import fp8_refusal
from autopipe.report import format_scaling
from autopipe.viz import collect_plot_data, plot_all, too_many_tasks

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.core.profile import Profile
    from autopipe.device_target import DeviceTarget

EPILOG = (
    "examples:\n  autopipe plan examples/gpt.py --gpus 8 --json plan.json\n"
    "  autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb\n"
    "  autopipe plan profile.json --gpus 4 --memory 16GiB\n"
    "  autopipe plan examples/gpt.py:gpt_6b --gpus 8 --device a100-80gb:4,v100-32gb:4 --dtype float16"
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
    _add_target_flags(p)
    _add_search_flags(p)
    _add_output_flags(p)
    _add_mesh_flags(p)
    _add_link_flags(p)
    _add_trainer_flags(p)
    p.add_argument(
        "--scaling",
        action="store_true",
        help="also plan K = 1..--gpus and print throughput and memory per K (and the fewest GPUs that fit)",
    )
    common.model_options(p)
    common.add_common_flags(p)
    p.set_defaults(func=cmd_plan)


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    """What to plan and on how many devices: the model, K (or N), M, memory."""
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


def _add_search_flags(p: argparse.ArgumentParser) -> None:
    """How the plan is searched: re-materialization, schedule, virtual stages, strategy."""
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


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where the plan goes besides the report: JSON, figures, the profile, emitters."""
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
        "JSON), torchtitan or torchtitan-0.2 (0.2.2's [parallelism] TOML), torchtitan-python "
        "or torchtitan-0.3 (0.3.0's Python config module) or megatron (layout and flags)",
    )
    p.add_argument(
        "--emit-out", metavar="PATH", help="write --emit's output to PATH (default: stdout)"
    )


def _add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """The device mesh PP x D x T: data and tensor parallelism, sharding of the training state."""
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
        "--context-parallel",
        metavar="auto|C",
        type=common.microbatches,
        help="split each sequence over C devices (torch's context_parallel, ring attention): "
        "--gpus N = PP x D x C x T; auto tries every C dividing half the sequence; plans the "
        "whole mesh (default there: 1)",
    )
    p.add_argument(
        "--context-parallel-method",
        choices=["ring", "ring_compiled", "all_gather"],
        default="ring",
        help="how context parallelism's attention exchanges keys and values: ring (torch's "
        "context_parallel, as autopipe run runs it; default), ring_compiled (that ring inside a "
        "torch.compile graph, as torchtitan compiles it: exchanges exposed, merges fused) or "
        "all_gather (gathered once and attended in one call: the Llama 3 paper's, Megatron's "
        "--cp-comm-type all_gather)",
    )
    p.add_argument(
        "--expert-parallel",
        metavar="auto|E",
        type=common.microbatches,
        help="spread each MoE layer's routed experts over E devices of D x C x T (torchtitan's "
        "expert parallelism, all-to-all dispatch); auto tries every E dividing the experts; "
        "plans the whole mesh (default there: 1)",
    )


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    """How the trainer runs the model (PlanRequest's trainer options, planner/trainer.py)."""
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="bf16",
        help="matmul precision: fp8 prices the weight matmuls at the GPU's FP8 peak "
        "(torchtitan Float8, Megatron --fp8-format); default bf16",
    )
    p.add_argument(
        "--selective-recompute",
        action="store_true",
        help="selective activation checkpointing: units keep their selective recipe's "
        "activations and re-compute the rest (Megatron --recompute-granularity selective)",
    )
    p.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="tensor parallelism without sequence parallelism (activations outside the TP "
        "regions replicated on every TP rank)",
    )
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="price the LM head's logits sharded over TP, the loss on the shards (torchtitan's "
        "default, Megatron's vocab-parallel cross-entropy); autopipe run gathers them",
    )
    p.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="overlap TP collectives with the matmuls (async TP, --tp-comm-overlap)",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="reduce unsharded gradients during the backward (Megatron --overlap-grad-reduce)",
    )
    p.add_argument(
        "--grad-reduce-fp32",
        action="store_true",
        help="reduce gradients in fp32 (Megatron --accumulate-allreduce-grads-in-fp32, "
        "FSDP2 reduce_dtype=float32)",
    )
    p.add_argument(
        "--fp32-grad-buffer",
        action="store_true",
        help="the trainer keeps an fp32 copy of every gradient beside the 16-bit one "
        "(DeepSpeed's BF16_Optimizer): 4 bytes per parameter more",
    )
    p.add_argument(
        "--optimizer-kernel",
        choices=OPTIMIZER_KERNELS,
        default="foreach",
        help="how the trainer runs the optimizer step, priced in a mesh plan: foreach "
        "(torch.optim's default, autopipe run's) or fused (torch fused=True, Megatron's "
        "FusedAdam)",
    )
    p.add_argument(
        "--grad-clip",
        choices=GRAD_CLIPS,
        default="none",
        help="gradient clipping before the step, priced in a mesh plan: none (autopipe "
        "run), torch (clip_grad_norm_, torchtitan) or megatron (--clip-grad)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="--shard parameters as FSDP2 runs under pipeline parallelism: gathered once "
        "per step and kept unsharded across micro-batches",
    )
    p.add_argument(
        "--memory-reserve",
        type=common.byte_size,
        metavar="BYTES",
        default=0,
        help="device memory the plan may not use (CUDA context, NCCL, fragmentation), e.g. 4GiB",
    )


def _add_link_flags(p: argparse.ArgumentParser) -> None:
    """The hardware between devices: nodes, links, a shared host, the all-reduce."""
    p.add_argument(
        "--gpus-per-node",
        type=common.positive_int,
        metavar="N",
        help="devices per node for the mesh (default: 8 for catalog GPUs, else all in one)",
    )
    p.add_argument(
        "--inter-node-bandwidth",
        type=common.bandwidth,
        metavar="RATE",
        help="per-device bandwidth between nodes for the mesh, e.g. 50GB/s (bytes) or "
        "400Gb/s (bits) (default: the "
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
        type=common.bandwidth,
        metavar="RATE",
        help="gradient all-reduce bandwidth per device for --data-parallel, e.g. 100GB/s "
        "(default: the catalog device's link); with the mesh flags, the link inside a node",
    )


def cmd_plan(args: argparse.Namespace) -> int:
    _check_outputs(args)
    devices = common.device_flags(args)  # the one resolution of --device / --device-spec
    # The typed request first: PlanRequest refuses a bad field itself (one line, exit 2).
    try:
        placement = _placement(args, devices)
    except RuleViolation as exc:
        raise common.UsageError(str(exc)) from exc
    _check_flags(args, devices)  # before spending time profiling
    if args.model.endswith(".json"):
        profile = common.load_profile_file(args.model)
        _refuse_profiling_flags(args, devices, profile)
    else:
        request = common.profile_request(args)
        # Counted (--device NAME): compiled stages planned on the unfused count (plan() warns).
        request = dataclasses.replace(request, compile=request.compile and not devices.counted_on)
        profile = profiling.profile_model_file(args.model, devices, request)
    _check_against_profile(args, profile)

    try:
        result = plan_on_devices(profile, placement)
    except RuleViolation as exc:  # a schedule, V or M torch would refuse: bad input
        raise common.UsageError(str(exc)) from exc
    except PlanningError as exc:
        raise common.Failure(str(exc)) from exc
    except ValueError as exc:  # e.g. a device list the profile cannot be priced for
        raise common.UsageError(str(exc)) from exc

    common.say(args, format_plan(result))
    if args.scaling:
        rows = scaling_rows(profile, placement)
        result.meta["scaling"] = rows
        common.say(args, "\n" + format_scaling(rows))
    _write_outputs(args, result, profile)
    return common.EXIT_OK


def _placement(args: argparse.Namespace, devices: DeviceTarget) -> Placement:
    """The flags as a :class:`autopipe.placement.Placement`: the typed request, the devices,
    and the layout beyond one pipeline. The mesh flags leave what they do not give ``auto``."""
    mesh = _plans_mesh(args)
    request = PlanRequest(
        gpus=args.gpus,
        memory_per_device=args.memory,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        checkpoint=args.checkpoint,
        strategy=args.strategy,
        optimizer=args.optimizer or "auto",
        bytes_per_parameter=args.bytes_per_parameter,
        tensor_parallel=(args.tensor_parallel or "auto") if mesh else 1,
        data_parallel=(args.data_parallel or "auto") if mesh else 1,
        shard=(args.shard or "auto") if mesh else "none",
        gpus_per_node=args.gpus_per_node,
        inter_node_bandwidth_bytes_per_s=args.inter_node_bandwidth,
        precision=args.precision,
        selective_recompute=args.selective_recompute,
        sequence_parallel=not args.no_sequence_parallel,
        loss_parallel=args.loss_parallel,
        tp_comm_overlap=args.tp_comm_overlap,
        grad_reduce_overlap=args.overlap_grad_reduce,
        grad_reduce_fp32=args.grad_reduce_fp32,
        fp32_grad_buffer=args.fp32_grad_buffer,
        reshard_after_forward=not args.no_reshard_after_forward,
        optimizer_kernel=args.optimizer_kernel,
        grad_clip=args.grad_clip,
        memory_reserve_bytes=int(args.memory_reserve or 0),
        context_parallel=args.context_parallel or 1,
        context_parallel_method=args.context_parallel_method,
        expert_parallel=args.expert_parallel or 1,
        compile=args.compile,
    )
    return Placement(
        request,
        devices,
        replicas=None if mesh else args.data_parallel,
        allreduce_bandwidth_bytes_per_s=args.allreduce_bandwidth,
        host_throughput=args.host_throughput,
    )


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse outputs that cannot be written, or that would overwrite each other or an input."""
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


def _check_flags(args: argparse.Namespace, devices: DeviceTarget) -> None:
    """Refuse flag combinations that cannot be planned, on the flags alone (O(1)): said
    before any time is spent profiling."""
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
    _check_tensor_parallel(args, devices)
    for flag in ("data_parallel", "scaling"):
        if args.host_throughput is not None and getattr(args, flag):
            raise common.UsageError(
                f"--host-throughput cannot be combined with --{flag.replace('_', '-')}: it "
                "prices one pipeline's K ranks on one host; drop one of the two"
            )
    listed = devices.listed_devices
    if listed and listed != args.gpus:
        raise common.UsageError(
            f"--device {args.device} lists {listed} devices but --gpus is {args.gpus}"
        )
    measured = not (args.device or args.device_spec or args.model.endswith(".json"))
    if args.data_parallel and not mesh and args.allreduce_bandwidth is None and measured:
        raise common.UsageError(NEED_BANDWIDTH)
    if mesh and args.allreduce_bandwidth is None and measured and args.gpus > 1:
        if any(d != 1 for d in (args.tensor_parallel, args.data_parallel)):  # None: auto
            raise common.UsageError(NEED_MESH_BANDWIDTH)
    if isinstance(args.data_parallel, int) and args.gpus % args.data_parallel:
        raise common.UsageError(
            f"--data-parallel {args.data_parallel} does not divide --gpus {args.gpus}: the "
            "GPUs are K stages x D replicas; give a divisor of --gpus or auto"
        )
    if args.batch_size:
        _check_replicas(args, args.batch_size)
    _check_schedule_rules(args)


def _check_tensor_parallel(args: argparse.Namespace, devices: DeviceTarget) -> None:
    """``--tensor-parallel T`` must divide the GPUs per node and ``--gpus``."""
    node = args.gpus_per_node or devices.gpus_per_node
    tp = args.tensor_parallel
    if node is not None and isinstance(tp, int) and node % tp:
        raise common.UsageError(
            f"--tensor-parallel {tp} does not divide the {node} GPUs per node: "
            "a TP group never spans nodes; give a divisor (or --gpus-per-node)"
        )
    if isinstance(tp, int) and args.gpus % tp:
        raise common.UsageError(
            f"--tensor-parallel {tp} does not divide --gpus {args.gpus}: "
            "the GPUs are PP x D x T; give a divisor of --gpus or auto"
        )


def _check_against_profile(args: argparse.Namespace, profile: Profile) -> None:
    """Refuse what the profile's units and batch size rule out (bad input: the planner
    would call it a failure)."""
    if args.gpus > len(profile.units) and not args.data_parallel and not _plans_mesh(args):
        raise common.UsageError(
            f"--gpus {args.gpus} is more than the model's {len(profile.units)} units; use at most "
            f"{len(profile.units)} or a finer --granularity (module or node)"
        )
    _check_precision(args, profile)
    batch = args.batch_size or profile.batch_size
    _check_replicas(args, batch)
    m = args.microbatches
    if isinstance(m, int) and batch % m:
        raise common.UsageError(
            f"--microbatches {m} does not divide the batch size {batch}; " + divisor_hint(batch, m)
        )


def _check_precision(args: argparse.Namespace, profile: Profile) -> None:
    """``--precision fp8`` needs the units' weight-matmul FLOPs (``linear_forward_flops``):
    refused on a profile without any (written before the profiler recorded them, or a model
    without weight matmuls), where it would change nothing; a warning when no unit carries
    the FP8 casts' bytes (autopipe's profiler does not count them: they depend on how the
    trainer's compiler fuses them), which then go unpriced."""
    if args.precision != "fp8":
        return
    refusal = fp8_refusal(profile)
    if refusal is not None:
        raise common.UsageError(f"--precision fp8: {args.model} {refusal}")
    if not any(u.fp8_cast_forward_bytes + u.fp8_cast_backward_bytes > 0 for u in profile.units):
        warnings.warn(
            "--precision fp8: this profile has no FP8 cast bytes (fp8_cast_*_bytes), so the "
            "casts to FP8 are not priced: the step is predicted faster than it runs "
            "(docs/cost-model.md, FP8)",
            stacklevel=1,
        )


def _refuse_profiling_flags(
    args: argparse.Namespace, devices: DeviceTarget, profile: Profile
) -> None:
    """Flags that shape profiling would be silently ignored for a saved profile: refuse them
    (``--device`` naming the device it was profiled on is no contradiction)."""
    ignored = [
        flag
        for flag, value in (
            ("--device-spec", args.device_spec),
            ("--dtype", args.dtype),
            ("--granularity", args.granularity),
            ("--units", args.units),
            ("--no-cache", args.no_cache),
            ("--meta-init", args.meta_init),
            ("--no-share", args.no_share),
            ("--no-split-backward", args.no_split_backward),
            ("--scale-to-reference", args.scale_to_reference),
        )
        if value
    ]
    single = args.device if args.device and not devices.pipeline else None
    if single and not profiled_on(profile, single):
        ignored.insert(0, f"--device {single}")
    if ignored:
        raise common.UsageError(
            f"{', '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} only when "
            f"profiling a model file; {args.model} was profiled on {profile.device} "
            f"({profile.mode}): profile MODEL.py with {'it' if len(ignored) == 1 else 'them'}"
        )


def _write_outputs(args: argparse.Namespace, result: Plan, profile: Profile) -> None:
    """--emit, --save-profile, --plot and --json, each only once the plan is made (a
    refusal writes nothing)."""
    emitted = None
    if args.emit:
        try:  # before any file is written: a format that cannot say the plan writes nothing
            emitted = emit(result, args.emit)
        except EmitError as exc:
            raise common.UsageError(f"--emit {args.emit}: {exc}") from exc
    if args.save_profile:
        profile.save(args.save_profile)
    if args.plot:
        _plot(args, result, profile)
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


def _plot(args: argparse.Namespace, result: Plan, profile: Profile) -> None:
    """--plot DIR: the five figures, their data kept in the plan written after."""
    too_many = too_many_tasks(result)
    if too_many is not None:  # the plan itself is fine: keep it, skip only the plots
        warnings.warn(f"--plot skipped: {too_many}", stacklevel=1)
        return
    data = collect_plot_data(result, profile)
    paths = plot_all(result, args.plot, plot_data=data, progress=not args.quiet)
    # Kept in the plan written below, so `autopipe plot PLAN.json` redraws all five.
    result.plot_data = data
    common.say(args, "plots: " + ", ".join(str(p) for p in paths))


def _check_schedule_rules(args: argparse.Namespace) -> None:
    """Refuse a forced ``--schedule`` (with ``--microbatches``) that torch would refuse, on
    the flags alone: the pre-flight rules that need no profile
    (``autopipe.core.schedule_rules.violations``; ``PlanRequest`` refused a V the schedule
    does not run already). The batch rules wait for the profile. O(1)."""
    if args.schedule == "auto":
        return

    v = args.virtual_stages
    if not isinstance(v, int):
        v = 2 if args.schedule in V_SHAPE_SCHEDULES else 1
    m = args.microbatches
    if not isinstance(m, int) or args.data_parallel or _plans_mesh(args):
        return  # M is chosen later; with --data-parallel K is too
    # batch = M passes the batch rules: they wait for the profile's batch (and its hint).
    problems = violations(args.schedule, args.gpus, v, m, m, compile=args.compile)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise common.UsageError(problems[0] + more)


def _check_replicas(args: argparse.Namespace, batch: int) -> None:
    """``--data-parallel D`` must divide the global batch: one line naming the D that do."""
    if not isinstance(args.data_parallel, int):
        return

    try:
        check_replicas_divide_batch(args.data_parallel, args.gpus, batch)
    except PlanningError as exc:
        raise common.UsageError(f"--data-parallel {args.data_parallel}: {exc}") from exc


def _plans_mesh(args: argparse.Namespace) -> bool:
    """Whether the flags ask for the whole device mesh rather than a K-stage pipeline (or
    the K x D layout of ``--data-parallel`` alone)."""
    return any(
        getattr(args, flag) is not None
        for flag in (
            "tensor_parallel",
            "shard",
            "gpus_per_node",
            "inter_node_bandwidth",
            "context_parallel",
            "expert_parallel",
        )
    )
