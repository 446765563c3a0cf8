"""The `nnx` trainer: `nnx-train`, `nnx-eval` and `nnx-inspect` driven by YAML configs.

The stages of a run, each in its own module: `config` (schema, overrides,
validation) -> `data` (datasets to arrays, batches by step) and `models`
(registry) and `optim` (optax by name) -> `sharding` (mesh, placement) ->
`steps` (pure jitted functions) -> `checkpoint` (Orbax) and `report`
(metrics.jsonl, progress, tables, PNG grids). `train`, `eval` and `inspect`
are the entry points.
"""
