"""Bridges to other serving systems. Each submodule imports its system only when used.

``vllm_harness``: replay a Trace through vLLM's real V1 scheduler on CPU (the ``vllm`` extra).
``vllm``: TokenBatch policies inside vLLM's own scheduler (``--scheduler-cls``; docs/vllm_plugin.md).
"""
