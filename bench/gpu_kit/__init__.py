"""The GPU benchmark kit's parts (``bench/gpu_bench.py`` runs them): model shapes, carried packages and files, the
correctness stages and the speed stages. Nothing here reaches for the network or a model hub."""
