"""`NNXLM`: lm-evaluation-harness's model API over an nnx language model, registered as `nnx`.

Importing this module registers the model with lm-eval, so that
`simple_evaluate(model="nnx", model_args="pretrained=runs/my_run")` and, from
lm-eval's own command line through `python -m nnx_cli.harness`, `--model nnx
--model_args pretrained=...` evaluate a run (its newest step, or `step=N`) or
a Hugging Face model directory or Hub id with the jitted model::

    import lm_eval
    from nnx_cli.harness.backend import NNXLM

    lm = NNXLM("runs/chat_lora", batch_size=32)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=100)

It answers requests as lm-eval's `hf` model does on the same weights
(tokenization with the tokenizer's special tokens, the continuation scored
after the last `max_length` tokens, rolling windows as `lm_eval.utils`
defines them, greedy generation to the task's `until` strings, the
end-of-sequence token or `max_gen_toks`), with the work in
:class:`nnx_cli.harness.engine.Engine`: requests sorted by length and
batched in buckets of padded lengths, rows split over the mesh.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from nnx_cli.errors import UserError
from nnx_cli.harness.engine import Engine
from nnx_cli.harness.target import Target, load_target

_log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's, when a task does not say


@register_model("nnx")
class NNXLM(TemplateLM):
    """lm-eval's `TemplateLM` over an nnx language model; see the module docstring.

    `pretrained` is a TARGET (a work dir, its `checkpoints/` dir or a step
    dir, or a Hugging Face model directory or Hub id) or a loaded
    :class:`~nnx_cli.harness.target.Target`. `step` / `best` pick a run's
    checkpoint; `batch_size` is the most rows per model call (`auto`: 32);
    `max_length` overrides the longest input (default: what lm-eval's `hf`
    model reads from config.json); `dtype` is the compute dtype (`float32`,
    `bfloat16`). Other lm-eval options (`device`, `max_batch_size`) do not
    apply: JAX uses every device the target's mesh names.
    """

    backend = "causal"

    def __init__(
        self,
        pretrained: str | Path | Target | None = None,
        step: int | str | None = None,
        best: bool = False,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        dtype: str | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        **ignored: Any,
    ) -> None:
        super().__init__()
        check_model_args(dict(pretrained=pretrained, step=step, best=best, max_length=max_length,
                              max_gen_toks=max_gen_toks, prefix_token_id=prefix_token_id))  # fmt: skip
        rows = check_batch_size(batch_size, "batch_size")
        if isinstance(pretrained, Target):
            target = pretrained
        else:
            overrides = [f"model.dtype={dtype}"] if dtype else []
            target = load_target(str(pretrained), overrides, step=None if step is None else int(step), best=bool(best))
        for name, value in ignored.items():
            if value is not None and name not in ("device", "max_batch_size"):
                _log.warning("model argument %s=%r is not one nnx takes; ignored", name, value)
        self.target = target
        self.tokenizer = target.tokenizer
        self.engine = Engine(
            target.exp.moduledef, target.params, batch_size=rows, mesh=target.exp.mesh, rules=target.exp.rules,
            max_length=int(target.max_length if max_length is None else max_length),
        )  # fmt: skip
        self._given_max_length = None if max_length is None else int(max_length)
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        self._stop_windows: dict[str, int] = {}
        self._task_of: dict[Any, str] = {}

    # --- what lm-eval asks of a model -----------------------------------------------------------------------

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.engine.batch_size

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-sequence token (`eos_token` of tokenizer_config.json), else its end of document."""
        eos = getattr(self.tokenizer, "eos_token", None)
        found = self.tokenizer.token_id(eos) if eos and hasattr(self.tokenizer, "token_id") else None
        return found if found is not None else self.tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: the begin-of-sequence token when the tokenizer has one, else end-of-sequence."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = getattr(self.tokenizer, "bos_token", None)
        found = self.tokenizer.token_id(bos) if bos and hasattr(self.tokenizer, "token_id") else None
        return found if found is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "directory", None) or self.tokenizer.name).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        import math

        import jax

        count = sum(math.prod(x.shape) for x in jax.tree.leaves(self.target.params))
        return {
            "model_num_parameters": count,
            "model_dtype": str(self.target.exp.cfg.model.options.get("dtype", "float32")),
            "nnx_target": self.target.name,
            "nnx_step": self.target.step,
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Ids of `string` as the `hf` model encodes them: with the tokenizer's special tokens (a Llama's
        begin-of-text) unless `add_special_tokens` is false or the text already starts with the prefix token."""
        left_truncate_len = kwargs.get("left_truncate_len")
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self._token_text(self.prefix_token_id))
        plain = getattr(self.tokenizer, "encode_plain", self.tokenizer.encode)
        ids = [int(t) for t in (self.tokenizer.encode(string) if add_special_tokens else plain(string))]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _token_text(self, token: int) -> str:
        if hasattr(self.tokenizer, "decode_all"):
            return self.tokenizer.decode_all([token])
        return self.tokenizer.decode([token])

    def _decode(self, tokens: list[int], skip_special_tokens: bool) -> str:
        if hasattr(self.tokenizer, "decode_all"):
            return self.tokenizer.decode_all(tokens, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(tokens)

    # --- log-likelihoods ------------------------------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        self._task_of = {tuple(r.args): r.task_name for r in requests if getattr(r, "task_name", None)}
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._task_of = {}

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        pairs = [(context, continuation) for _, context, continuation in requests]
        for request, _, continuation in requests:
            if len(continuation) > self.max_length:
                raise UserError(self._too_long(request, len(continuation)))
        with tqdm(total=len(pairs), disable=disable_tqdm, desc="Running loglikelihood requests") as bar:
            answers = self.engine.loglikelihoods(pairs, progress=bar.update)
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def _too_long(self, request: Any, tokens: int) -> str:
        """The message for a continuation of `tokens` tokens, longer than the model reads: it cannot be scored."""
        name = self._task_of.get(tuple(request)) if isinstance(request, (tuple, list)) else None
        task = f"task {name!r}" if name else "a task"
        scored = f"{task} scores a continuation of {tokens} tokens"
        if self._given_max_length is None:
            return (
                f"--tasks: {scored}, more than the model's context of {self.max_length} tokens (its max_length): "
                "this model cannot score it; leave that task out"
            )
        limit = self.engine.context_limit
        fix = f"give max_length={tokens} or more" if limit is None or tokens <= limit else (
            f"the model reads no more than {limit}: leave that task out"
        )  # fmt: skip
        return (
            f"--model_args max_length={self._given_max_length}: {scored}, more than the {self.max_length} positions "
            f"the model reads with that max_length; {fix}"
        )

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of whole documents, in windows of `max_length` tokens as lm-eval defines them
        (`lm_eval.utils.get_rolling_token_windows`, made disjoint): each token predicted once, with as much
        context as fits."""
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for i, (string,) in enumerate(request.args for request in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1,
            )  # fmt: skip
            for window in map(lm_utils.make_disjoint_window, rolling):
                windows.append(window)
                owners.append(i)
        with tqdm(total=len(windows), disable=disable_tqdm, desc="Running loglikelihood_rolling windows") as bar:
            answers = self.engine.loglikelihoods(windows, progress=bar.update)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, answers):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -----------------------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continuations drawn from the key-value cache (greedy unless a task samples), each ending at the
        first of the task's `until` strings, the end-of-sequence token or `max_gen_toks` tokens, with the stop
        string cut off; requests with the same generation options are batched together."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        answers = [""] * len(requests)
        eos = self._token_text(self.eot_token_id)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests") as bar:
            for indices in groups.values():
                options = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
                until = handle_stop_sequences(options.pop("until", None), eos=eos)
                max_gen_toks = options.pop("max_gen_toks")
                longest = self.max_length - max_gen_toks
                if longest <= 0:
                    name = getattr(requests[indices[0]], "task_name", None)
                    task = f"task {name!r}" if name else "a task"
                    given = (
                        "" if self._given_max_length is None else f" (--model_args max_length={self._given_max_length})"
                    )
                    raise UserError(
                        f"--tasks: {task} generates up to {max_gen_toks} tokens (max_gen_toks, lm-eval's default "
                        f"256), no fewer than the model's context of {self.max_length}{given}: nothing is left for the "
                        "prompt; set a smaller max_gen_toks in the task's generation_kwargs"
                    )
                prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=longest) for i in indices]
                windows = [(s, len(self.tok_encode(s, add_special_tokens=False)) + 2) for s in until]

                def reached(row: int, tokens: list[int], windows: list = windows) -> bool:
                    """Whether a stop string shows in the last tokens, as the `hf` model's stopping criteria see
                    them (special tokens written out)."""
                    return any(s in self._decode(tokens[-w:], False) for s, w in windows)

                drawn = self.engine.generate(
                    prompts, max_tokens=max_gen_toks, stop_tokens=self._stop_ids(), done=reached,
                    **_sampling(options), progress=bar.update,
                )  # fmt: skip
                for i, (tokens, stopped_by) in zip(indices, drawn):
                    text = self._decode(tokens + ([stopped_by] if stopped_by is not None else []), True)
                    answers[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, answers[i])
        return answers

    def _stop_ids(self) -> list[int]:
        """Where `transformers`' generate stops a row: generation_config.json's end-of-sequence ids (else the end of
        a document: `data.tokenizers.stop_ids`)."""
        from nnx_cli.data.tokenizers import stop_ids

        return list(stop_ids(self.tokenizer))

    # --- chat templates -------------------------------------------------------------------------------------

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self.target.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the model's chat template (in Jinja's sandbox, as `transformers`
        renders it); without `add_generation_prompt` the last message is left open, to be continued."""
        from nnx_cli.data import chat
        from nnx_cli.errors import UserError

        template = self.target.chat_template
        if template is None:
            raise UserError(
                f"--apply-chat-template needs a chat template, and {self.target.name!r} has none "
                "(chat_template.jinja, or chat_template in tokenizer_config.json)"
            )
        specials = chat.special_tokens(self.tokenizer)
        try:
            text = chat.render(template, chat_history, add_generation_prompt=add_generation_prompt,
                               special_tokens=specials)  # fmt: skip
        except chat.TemplateFailed:  # as lm-eval does: try again without the system turn
            chat_history = [m for m in chat_history if m["role"] != "system"]
            text = chat.render(template, chat_history, add_generation_prompt=add_generation_prompt,
                               special_tokens=specials)  # fmt: skip
        if not add_generation_prompt and chat_history:
            content = str(chat_history[-1]["content"]).strip()
            end = text.rfind(content)
            if content and end >= 0:
                text = text[: end + len(content)]
        return text


RUN_TARGET = "<run dir, model dir or .gguf file>"


def check_model_args(args: dict[str, Any]) -> None:
    """The model arguments lm-eval passes (`--model_args key=value,...`, values as lm-eval converts them) that nnx
    reads, checked before anything is loaded: a UserError naming the first one that is missing or wrong."""
    if args.get("pretrained") in (None, ""):
        raise UserError(f"--model_args needs pretrained={RUN_TARGET}")
    for name, least in (("step", 0), ("max_length", 1), ("max_gen_toks", 1), ("prefix_token_id", 0)):
        if args.get(name) is not None:
            _whole(name, args[name], least)
    best = args.get("best")
    if best is not None and not (isinstance(best, bool) or best in (0, 1)):
        raise UserError(f"--model_args best={best}: best must be true or false")


def check_batch_size(value: Any, flag: str = "--batch_size") -> int:
    """Rows per model call: a whole number of at least 1, or lm-eval's `auto` / `auto:N` (32 rows); None: 32."""
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH_SIZE
    number = _number(value)
    if number is None:
        raise UserError(f"{flag} must be a whole number of rows (or auto), got {value!r}")
    if number < 1:
        raise UserError(f"{flag} must be at least 1, got {number}")
    return number


def _number(value: Any) -> int | None:
    """`value` as a whole number (`4`, `"4"`, `4.0`), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _whole(name: str, value: Any, least: int) -> int:
    number = _number(value)
    if number is None:
        raise UserError(f"--model_args {name}={value}: {name} must be a whole number")
    if number < least:
        raise UserError(f"--model_args {name}={value}: {name} must be {least} or more")
    return number


def _sampling(options: dict[str, Any]) -> dict[str, Any]:
    """The decoder's sampling options from lm-eval's normalized generation options (greedy unless `do_sample`)."""
    if not options.get("do_sample"):
        return {"temperature": 0.0}
    return {
        "temperature": float(options.get("temperature", 1.0)) or 1.0,
        "top_k": int(options.get("top_k") or 0),
        "top_p": float(options.get("top_p") or 1.0),
        "seed": int(options.get("seed") or 0),
    }
