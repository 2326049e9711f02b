"""Exhibits: code the course asks learners to review, kept exactly as written (flaws included).

- ``causal_forward_kernel``: the classmate's causal GQA forward of lesson 05b.
"""
