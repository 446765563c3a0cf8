"""lm-evaluation-harness tasks on nnx models: every response equal to what lm-eval's own `hf` model answers on
the same directory (goldens from tests/fixtures/make_harness_fixtures.py), the engine's batching, and the
command line around it."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from harness_support import TASKS, compare, compare_metrics, copy_tasks, golden
from hf_support import fixture
from xla_support import DEPLOYED

from nnx_cli import harness
from nnx_cli.harness.backend import NNXLM
from nnx_cli.harness.engine import Engine, bucket_length
from nnx_cli.harness.target import load_target


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The fixture tasks and data, and the directory lm-eval runs in (with a datasets cache of its own)."""
    import datasets

    root = tmp_path_factory.mktemp("harness")
    copy_tasks(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
        yield root


@pytest.fixture(scope="module")
def tasks(root):
    return harness.load_tasks(list(TASKS), include_path=root / "tasks")


@pytest.fixture(scope="module")
def llama():
    return load_target(str(fixture("llama")))


@pytest.fixture(scope="module")
def gpt2():
    return load_target(str(fixture("gpt2")))


# Equal to lm-eval's hf model
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_response_equals_what_lm_evals_hf_model_answers(root, tasks, name, request):
    lm = NNXLM(request.getfixturevalue(name), batch_size=8)
    results = harness.evaluate(lm, tasks, log_samples=True, bootstrap_iters=0)
    compare(results["samples"], golden(name))
    compare_metrics(harness.flat_metrics(results), golden(name))


def test_with_the_chat_template_every_response_equals_what_lm_evals_hf_model_answers(root, llama):
    chat_tasks = harness.load_tasks(["local_choices", "local_until"], include_path=root / "tasks")
    results = harness.evaluate(NNXLM(llama, batch_size=8), chat_tasks, log_samples=True, apply_chat_template=True,
                               bootstrap_iters=0)  # fmt: skip
    compare(results["samples"], golden("llama_chat"))
    compare_metrics(harness.flat_metrics(results), golden("llama_chat"))


# The engine
# --------------------------------------------------------------------------------------------------------------


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_loglikelihoods_sum_a_full_forward_pass_and_greedy_means_every_token_is_the_argmax(llama):
    engine = Engine(llama.exp.moduledef, llama.params, max_length=llama.max_length)
    forward = jax.jit(lambda params, tokens: engine.moduledef.merge(params).logits(tokens)[0])
    context = [0, 40, 41, 60, 61, 70]
    sequence = np.zeros((1, 16), np.int32)  # causal: what follows a position does not change its logits
    sequence[0, : len(context)] = context
    greedy = []
    for i in range(4):  # the model's own greedy continuation, one token at a time
        greedy.append(int(np.argmax(forward(engine.params, sequence)[len(context) - 1 + i])))
        sequence[0, len(context) + i] = greedy[-1]
    other = greedy[:2] + [(greedy[2] + 1) % 300] + greedy[3:]
    sequence[0, len(context) : len(context) + 4] = other
    logprobs = _log_softmax(np.asarray(forward(engine.params, sequence), np.float64))
    expected = sum(logprobs[len(context) - 1 + i, t] for i, t in enumerate(other))
    (mine, is_greedy), (theirs, not_greedy) = engine.loglikelihoods([(context, greedy), (context, other)])
    assert is_greedy and not not_greedy
    assert abs(theirs - expected) < 1e-5 * abs(expected)
    assert mine > theirs


def _counting(engine: Engine, name: str = "_score") -> list[tuple[tuple[int, ...], ...]]:
    """Record the shapes of every batch the engine scores (by `_score`, or `_score_shared`)."""
    shapes: list[tuple[tuple[int, ...], ...]] = []
    score = getattr(engine, name)

    def counted(*args):
        shapes.append(tuple(np.shape(a) for a in args[3 if name == "_score" else 4 :]))  # past the parameters
        return score(*args)

    setattr(engine, name, counted)
    return shapes


def test_a_bfloat16_table_read_in_float32_is_scored_as_its_bits_in_its_own_memory():
    """A bitsandbytes directory at its default `model.dtype: float32` has a bfloat16 table the model reads wider:
    the engine gives it to its programs as its bits, in the table's own memory (given it in bfloat16, each call
    copied it to its bits to slice it), and scores what it scores given the table as it is. Where XLA slices
    bfloat16 as it is (JAX 0.11 on) it gives the table as it is, and no call copies it."""
    import jax.numpy as jnp

    import nnx
    from nnx_cli import decoding
    from nnx_cli.harness import engine as engines
    from nnx_cli.models.transformer.residuals import packs
    from nnx_cli.models.transformer_lm import TransformerLM

    model = TransformerLM((16,), 40_000, num_layers=1, num_heads=2, embed_dim=256, dropout=0.0,
                          quantize={"type": "bfloat16"}, ctx=nnx.context(0))  # fmt: skip
    params, moduledef = model.partition(nnx.Param)
    engine = Engine(moduledef, params, max_length=16, batch_size=2)
    table = params["embedding/embedding"].value
    tables = [v.value for path, v in params.items() if path.endswith("embedding")]  # tokens, positions
    bits = [x for x in engine._leaves if x.dtype == jnp.uint16]
    pointers = {t.unsafe_buffer_pointer() for t in tables}
    if packs():
        assert {b.unsafe_buffer_pointer() for b in bits} == pointers
    else:  # JAX 0.11 on: the tables as they are
        assert not bits and pointers <= {x.unsafe_buffer_pointer() for x in engine._leaves}
    inputs = (jnp.ones((2, 16), jnp.int32), jnp.full((2,), 16, jnp.int32), jnp.zeros((2, 1), jnp.int32))
    given, layout = decoding.held_leaves(engine.params, set())  # the table in bfloat16, as before

    def temporaries(layout, leaves) -> int:
        compiled = engines._SCORE.lower(engine.moduledef, layout, leaves, *inputs).compile(compiler_options=DEPLOYED)
        return compiled.memory_analysis().temp_size_in_bytes

    if packs():
        assert temporaries(engine._layout, engine._leaves) < temporaries(layout, given) - table.nbytes / 2
    else:
        assert not bits and temporaries(engine._layout, engine._leaves) < table.nbytes / 2
    ours = engines._SCORE(engine.moduledef, engine._layout, engine._leaves, *inputs)
    for a, b in zip(ours, engines._SCORE(engine.moduledef, layout, given, *inputs), strict=True):
        np.testing.assert_array_equal(a, b)


def test_continuations_of_one_context_are_scored_after_one_pass_over_it(llama):
    engine = Engine(llama.exp.moduledef, llama.params, max_length=llama.max_length, batch_size=8)
    shared = _counting(engine, "_score_shared")
    question = [0, 40, 41, 60, 61, 70]
    choices = [[80], [81, 82], [83, 84, 85, 86, 87], [88, 89, 90]]
    answers = engine.loglikelihoods([(question, choice) for choice in choices])
    (contexts, _, rows, continuations, _), *more = shared
    assert not more and contexts == (1, 16) and rows == (4,) and continuations == (4, 8)
    one_by_one = [engine.loglikelihoods([(question, choice)])[0] for choice in choices]  # a pass over each
    np.testing.assert_allclose([a for a, _ in answers], [a for a, _ in one_by_one], rtol=1e-5)
    assert [g for _, g in answers] == [g for _, g in one_by_one]


@pytest.mark.parametrize("name", ["mistral_window", "gemma2"])
def test_with_sliding_windows_continuations_after_a_shared_context_score_as_one_pass_does(name):
    target = load_target(str(fixture(name)))  # windows of 8: a ring cache on every layer, or alternating layers
    engine = Engine(target.exp.moduledef, target.params, max_length=target.max_length, batch_size=8)
    shared = _counting(engine, "_score_shared")
    rng = np.random.default_rng(1)
    questions = [[2, *rng.integers(5, 300, 19)], [2, 40, 41, 60]]  # longer, and shorter, than the window
    choices = [list(rng.integers(5, 300, n)) for n in (1, 3, 6, 11)]  # the longest runs past the window itself
    requests = [(question, choice) for question in questions for choice in choices]
    answers = engine.loglikelihoods(requests)
    assert [contexts for contexts, *_ in shared] == [(1, 32), (1, 16)]  # each question's context once
    one_pass = [engine.loglikelihoods([request])[0] for request in requests]  # the whole input through the model
    np.testing.assert_allclose([a for a, _ in answers], [a for a, _ in one_pass], rtol=1e-5)
    assert [g for _, g in answers] == [g for _, g in one_pass]


def test_requests_whose_inputs_are_the_same_tokens_share_a_row(llama):
    engine = Engine(llama.exp.moduledef, llama.params, max_length=llama.max_length, batch_size=8)
    alone = _counting(engine)
    context = [0, 40, 41, 60, 61, 70]  # the same input, other final tokens: one row (no shared context: cut off)
    requests = [(context * 50, [80, t]) for t in (81, 82, 83)]
    answers = engine.loglikelihoods(requests)
    assert alone == [((1, 256), (1,), (1, 4))]
    one_by_one = [engine.loglikelihoods([request])[0] for request in requests]
    np.testing.assert_allclose([a for a, _ in answers], [a for a, _ in one_by_one], rtol=1e-6)


def test_a_task_compiles_a_handful_of_shapes_not_one_per_request(llama):
    engine = Engine(llama.exp.moduledef, llama.params, max_length=llama.max_length, batch_size=8)
    shapes = _counting(engine)
    rng = np.random.default_rng(0)
    requests = [(list(rng.integers(5, 290, n)), list(rng.integers(5, 290, 3))) for n in rng.integers(20, 60, 60)]
    engine.loglikelihoods(requests)
    assert {tokens[1] for tokens, _, _ in shapes} == {32, 64}  # inputs of 22 to 61 tokens
    assert all(tokens[0] & (tokens[0] - 1) == 0 for tokens, _, _ in shapes)  # powers of two
    assert len(set(shapes)) <= 4 and len(shapes) >= len(requests) // 8


def test_padded_lengths_come_in_a_few_buckets():
    assert [bucket_length(n) for n in (1, 16, 17, 64, 65, 129, 193, 257, 385, 700)] == [
        16, 16, 32, 64, 128, 192, 256, 384, 512, 768,
    ]  # fmt: skip
    assert bucket_length(60, limit=48) == 48  # learned positions end there


def test_generation_stops_where_the_callers_test_says_and_at_stop_tokens(llama):
    engine = Engine(llama.exp.moduledef, llama.params, max_length=llama.max_length, batch_size=4)
    prompts = [[0, 40, 41], [0, 60, 61, 62, 63], [0, 70]]
    free = engine.generate(prompts, max_tokens=12)
    assert all(len(tokens) == 12 or stop is not None for tokens, stop in free)
    cut = engine.generate(prompts, max_tokens=12, done=lambda row, tokens: len(tokens) >= 2 + row)
    for row, ((tokens, stop), (whole, _)) in enumerate(zip(cut, free)):
        assert tokens == whole[: len(tokens)] and stop is None
        assert len(tokens) == min(2 + row, len(whole))
    stopped = engine.generate(prompts, max_tokens=12, stop_tokens=[free[0][0][3]])
    assert stopped[0] == (free[0][0][:3], free[0][0][3])


def test_the_engine_takes_new_parameters_without_recompiling(llama):
    engine = Engine(llama.exp.moduledef, llama.params, max_length=llama.max_length, batch_size=4)
    request = [([0, 40, 41], [60, 61])]
    before = engine.loglikelihoods(request)[0][0]
    compiled = engine._score._cache_size()
    engine.set_params(jax.tree.map(lambda x: x * 0.5, engine.params))
    after = engine.loglikelihoods(request)[0][0]
    assert after != before and engine._score._cache_size() == compiled


def test_records_and_flat_metrics_name_each_task_and_metric(tmp_path):
    results = {
        "results": {"a": {"alias": "a", "acc,none": 0.5, "acc_stderr,none": 0.1},
                    "b": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"}},
        "versions": {"a": 1.0, "b": 2.0}, "n-shot": {"a": 0, "b": 5}, "higher_is_better": {"a": {"acc": True}},
    }  # fmt: skip
    assert harness.flat_metrics(results) == {"a/acc": 0.5, "b/exact_match,strict-match": 0.25}
    harness.write_records(tmp_path, 100, results, limit=10)
    harness.write_records(tmp_path, 200, results)
    records = [json.loads(line) for line in (tmp_path / harness.RECORDS).read_text().splitlines()]
    assert [(r["step"], r["task"], r["version"], r["num_fewshot"], r["limit"]) for r in records] == [
        (100, "a", 1.0, 0, 10), (100, "b", 2.0, 5, 10), (200, "a", 1.0, 0, None), (200, "b", 2.0, 5, None),
    ]  # fmt: skip
    assert harness.read_records(tmp_path) == [
        {"step": 100, "split": "harness", "metrics": {"a/acc": 0.5, "b/exact_match,strict-match": 0.25}},
        {"step": 200, "split": "harness", "metrics": {"a/acc": 0.5, "b/exact_match,strict-match": 0.25}},
    ]


def test_the_example_task_of_ones_own_runs_as_its_comments_say(root, llama, monkeypatch):
    repository = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(repository)
    tasks = harness.load_tasks(["valley_qa"], include_path=repository / "examples" / "harness")
    results = harness.evaluate(NNXLM(llama, batch_size=8), tasks, limit=3, bootstrap_iters=0)
    assert set(harness.flat_metrics(results)) == {"valley_qa/acc", "valley_qa/acc_norm"}
    assert results["n-samples"]["valley_qa"] == {"original": 8, "effective": 3}


def test_num_fewshot_and_limit_override_what_each_task_says(root, llama):
    tasks = harness.load_tasks(["local_choices"], include_path=root / "tasks")
    results = harness.evaluate(NNXLM(llama, batch_size=8), tasks, num_fewshot=0, limit=3, log_samples=True,
                               bootstrap_iters=0)  # fmt: skip
    assert results["n-shot"]["local_choices"] == 0 and len(results["samples"]["local_choices"]) == 3
    first = results["samples"]["local_choices"][0]
    assert first["arguments"][0][0] == first["doc"]["question"]  # no examples before the question


def test_a_group_runs_its_tasks_and_reports_its_own_aggregate(root, llama, tmp_path):
    (root / "tasks" / "local_group.yaml").write_text(
        "group: local_group\ntask: [local_choices]\n"
        "aggregate_metric_list: [{metric: acc, aggregation: mean, weight_by_size: true}]\nmetadata: {version: 1.0}\n"
    )
    tasks = harness.load_tasks(["local_group"], include_path=root / "tasks")
    results = harness.evaluate(NNXLM(llama, batch_size=8), tasks, limit=2, bootstrap_iters=0)
    metrics = harness.flat_metrics(results)
    assert metrics["local_group/acc"] == metrics["local_choices/acc"]
    harness.write_records(tmp_path, 7, results)
    assert [r["task"] for r in map(json.loads, (tmp_path / harness.RECORDS).read_text().splitlines())] == [
        "local_choices", "local_group",
    ]  # fmt: skip
    assert "local_group" in harness.results_table(results)
