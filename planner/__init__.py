"""autopipe.planner: Profile + cluster -> Plan. Never imports torch.

``plan`` picks the schedule, virtual stages, chunks, micro-batch count and checkpointing (exact
DP by default; ``preflight`` checks a plan against torch's rules);
``simulate`` runs the discrete-event model of a schedule and returns its ``Timeline`` (the one
timeline type, which the runtime also records and the plots draw: ``autopipe/core/timeline.py``);
``scaling_report``/``min_gpus`` sweep the GPU count. PuLP is imported only when ``strategy="ilp"`` is asked for.
"""

from autopipe.planner.data_parallel import (
    ParallelChoice,
    choose_pipeline_data_parallel,
    plan_data_parallel,
)
from autopipe.planner.errors import PlanningError, RuleViolation, check_plan
from autopipe.planner.planning import plan
from autopipe.planner.search import STRATEGIES
from autopipe.planner.simulate import Simulation, simulate, simulate_plan
from autopipe.planner.sweep import min_gpus, plan_each_schedule, scaling_report

from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import PLAN_VERSION, Plan, PlanFormatError, StagePlan, load_plan
from autopipe.core.schedule_rules import preflight
from autopipe.core.timeline import Task, Timeline

__all__ = [
    "PLAN_VERSION",
    "STRATEGIES",
    "Cluster",
    "Device",
    "ParallelChoice",
    "choose_pipeline_data_parallel",
    "plan_data_parallel",
    "Plan",
    "PlanFormatError",
    "PlanningError",
    "RuleViolation",
    "Simulation",
    "StagePlan",
    "Task",
    "Timeline",
    "check_plan",
    "load_plan",
    "min_gpus",
    "plan",
    "plan_each_schedule",
    "preflight",
    "scaling_report",
    "simulate",
    "simulate_plan",
]
