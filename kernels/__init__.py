"""Triton kernels for LongStraw, installed as `longstraw.kernels` (never as a top-level `kernels`).

Each kernel is one file holding the Triton kernel, its autograd.Function and a plain-torch reference that is also
the CPU path. Imports here are torch and triton only.
"""
