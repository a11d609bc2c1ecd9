"""autopipe.planner: Profile + cluster -> Plan. Never imports torch."""

from autopipe.planner.cluster import Cluster, Device
from autopipe.planner.plan import PLAN_VERSION, Plan, PlanFormatError, StagePlan, load_plan

__all__ = ["PLAN_VERSION", "Cluster", "Device", "Plan", "PlanFormatError", "StagePlan", "load_plan"]
