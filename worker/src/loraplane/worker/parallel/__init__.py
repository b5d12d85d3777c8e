"""Parallel groups of one worker: TP, DP attention, attn-TP and MoE-TP."""
