"""Triton kernels of the fused linear + cross-entropy, and their launch and tuning policy.

``forward.py``   the loss kernel (matmul with an online-logsumexp epilogue) and the split combine
``backward.py``  the dlogits kernel (recompute, one vocabulary chunk) and the GEMM accumulation policy
``configs.py``   named tile configs and the tables that choose them
``launch.py``    ``unsupported_reason``, ``forward``, ``backward``: what ``ops.py`` calls

Importing this package imports nothing from triton; ``launch`` does (ops imports it lazily).
"""
