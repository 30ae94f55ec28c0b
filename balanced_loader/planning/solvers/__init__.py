"""Shared machinery of the FlexSP, BatchAda and Hydraulis policies.

* :mod:`.solver`: HiGHS through ``scipy.optimize.milp``, with limits and outcomes spelled out.
* :mod:`.blaster`: FlexSP's min-max chunking and length-bucketing DPs (numba + references).
* :mod:`.sp_groups`, :mod:`.sp_milp`: one microbatch's sequence-parallel groups (greedy,
  bucketed MILPs, local search, lane placement).
* :mod:`.bins`: longest-processing-time placement of bins onto lane blocks.
* :mod:`.candidates`: Hydraulis's candidate DP over a length histogram, and candidate files.
* :mod:`.assign`: Hydraulis's stage 1 (docs to pipelines) and stage 2 (microbatch packing).
"""
