"""The CUDA kernels, their thin cupy wrappers and their bit-exact numpy twins.

``kernels.cu`` (one translation unit, one ``RawModule`` per device) includes the
sections in this folder: ``common.cuh``, ``burst.cuh``, ``stubs.cuh``, ``sampling.cuh``.
``cuda_ops`` and ``reference`` are the two op namespaces a :class:`~graphburst.backend.Backend`
runs: ``*_cuda`` wrappers and ``*_ref`` twins, with the same signatures.
"""
