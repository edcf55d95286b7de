import gc
import os

# The collector is paused until the command starts (app/cli.py then imports torch, freezes what is there and resumes
# it): Hydra's and torch's ~200,000 import-made objects live to the end, and each full collection while they were
# made walked all of them (a one-line CPU make translate: 4.9 -> 4.2 s, docs/benchmarking.md).
gc.disable()

# oneDNN's caches of kernels made for one shape (PyTorch's LRU_CACHE_CAPACITY and oneDNN's own, 1,024 each by
# default): a CPU decoding meets a new shape at every batch size, so a long make translate or make serve grew by
# ~0.5 GB a few hundred batches in before they filled. 128 each hold a decoding's shapes at the same speed
# (docs/configuration.md#files-of-any-size-translatewindow-translateresume). Read when torch loads oneDNN, so set
# before the first import of torch; a value in the environment wins.
for cache in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(cache, "128")

from app.cli import main  # noqa: E402

try:
    main()
finally:
    # Interpreter shutdown would garbage-collect every object torch, dynamo and datasets made at import, after the
    # command's last line (docs/benchmarking.md#measurements-behind-the-code). Frozen objects are left out of those
    # collections; the exit handlers still run (logs, host worker, files), the system frees the memory.
    gc.freeze()
