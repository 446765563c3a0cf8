"""XLA's options for programs whose memory a test measures: as XLA compiles them outside the tests.

The session turns XLA's CPU fusion emitters off to compile faster (conftest). Some copies are made only by the
emitters (a 16-bit array converted back from its bits for a product, a table converted to bits for a loop of
slices), so a program compiled without them can show fewer temporaries than it holds in a run::

    compiled = jax.jit(step).lower(*args).compile(compiler_options=DEPLOYED)
    compiled.memory_analysis().temp_size_in_bytes
"""

from __future__ import annotations

import os

DEPLOYED: dict[str, bool] | None = (
    {"xla_cpu_use_fusion_emitters": True}
    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
    else None
)
