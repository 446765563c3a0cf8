"""The command-line entry points, one module each (`[project.scripts]` in pyproject.toml):

- `nnx-train CONFIG`       :mod:`.train`: the training recipe, read top to bottom
- `nnx-eval TARGET`        :mod:`.eval`: a run's eval split, or lm-evaluation-harness tasks
- `nnx-inspect TARGET`     :mod:`.inspect`: the state a config or run holds, its shapes, shardings and bytes
- `nnx-generate TARGET`    :mod:`.generate`: continue a prompt with a language model
- `nnx-plot WORKDIR...`    :mod:`.plot`: metric curves of runs
- `nnx-export TARGET OUT`  :mod:`.export`: a Hugging Face model directory, an adapter or a GGUF file
- `nnx-configs ls | cp`    :mod:`.configs`: the configs that ship with nnx

The console scripts of the four that compute start through :mod:`.launch`, which sets the process up for
large buffers first. Each parses its arguments and hands the work to the modules beside this package; nothing
else imports them but `train`'s recipe and `configs`' lookup of a shipped config by name.
"""
