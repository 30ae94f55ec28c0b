"""Spindle (ASPLOS'25): wavefront scheduling of multi-task, multi-modal models.

``graph`` (the YAML graph file) -> ``allocator`` (per-frontier bisection and slices) ->
``waves`` (greedy wave packer) -> ``placement`` (contiguous, node-aligned ranks) ->
``planner.plan_waves`` (with the ``baselines``), giving a ``schedule.WavePlan``.
"""

from __future__ import annotations

from balanced_loader.spindle.graph import Graph, MetaOp, graph_from_dict, load_graph
from balanced_loader.spindle.planner import plan_waves
from balanced_loader.spindle.wave_plan import Wave, WaveOp, WavePlan, batch_shards

__all__ = ["Graph", "MetaOp", "Wave", "WaveOp", "WavePlan", "batch_shards", "graph_from_dict", "load_graph",
           "plan_waves"]
