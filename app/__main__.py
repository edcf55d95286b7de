import gc

from app.cli import main

try:
    main()
finally:
    # Interpreter shutdown would garbage-collect every object torch, dynamo and datasets made at import, after the
    # command's last line (docs/benchmarking.md#measurements-behind-the-code). Frozen objects are left out of those
    # collections; the exit handlers still run (logs, host worker, files), the system frees the memory.
    gc.freeze()
