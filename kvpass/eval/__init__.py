"""Evaluation harness: run policies over tasks on a real model and compare them with ``full``."""

from kvpass.eval.runner import PolicyResult, Runner, TaskResult, cache_bytes, compare

__all__ = ["compare", "Runner", "PolicyResult", "TaskResult", "cache_bytes"]
