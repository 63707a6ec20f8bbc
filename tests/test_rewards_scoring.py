"""Rule scorers, the scorer registry, the reward manager's worker pool, and the reward model."""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import reasoning_gym
import torch
from helpers import PAD, byte_tokenizer, make_batch
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from creditrl.config.schema import RewardConfig, RewardModelConfig
from creditrl.errors import UserCodeError
from creditrl.models.model_dir import ModelError
from creditrl.rewards import inprocess, pool, worker
from creditrl.rewards.manager import RewardManager
from creditrl.rewards.registry import (
    SCORERS,
    get_scorer,
    portable_spec,
    register_scorer,
    scorer_spec,
)
from creditrl.rewards.reward_model import RewardModelWorker
from creditrl.rewards.scorers import gsm8k_score, math_score, reasoning_gym_score

# A user scorer file for the worker-pool tests: its behaviour is chosen by the response text.
USER_SCORERS = textwrap.dedent(
    """
    import math, time

    def dispatch(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        if "RAISE" in solution_str:
            raise ValueError("scorer exploded on purpose")
        if "HANG" in solution_str:
            time.sleep(60)
        if "NAN" in solution_str:
            return math.nan
        if "PRINT" in solution_str:
            print("noise on stdout", flush=True)
        if "SLEEP" in solution_str:
            time.sleep(0.5)
        if "BIG" in solution_str:
            return 1e300
        if "NEG" in solution_str:
            return -1e39
        if "SUBMETRIC" in solution_str:
            return {"score": 1.0, "acc": 1e300}
        if "DEEP" in solution_str:
            tree = 0
            for _ in range(100_000):
                tree = {"a": tree}
            return {"score": 1.0, "tree": tree}
        if "LONGLIST" in solution_str:
            return {"score": 1.0, "xs": [0] * 10**7}
        if "HUGESTR" in solution_str:
            return {"score": 1.0, "s": "x" * 10**8}
        return {"score": float(len(solution_str)), "echo": ground_truth, **kwargs}

    def other(data_source, solution_str, ground_truth, extra_info=None):
        return 7
    """
)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


@pytest.fixture(scope="module")
def user_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scorers") / "my_scorers.py"
    path.write_text(USER_SCORERS)
    return path


@pytest.fixture(scope="module")
def pool_manager(tok, user_file):
    """Two worker processes, 1 s timeout, every sample scored by ``my_scorers.py:dispatch``."""
    cfg = RewardConfig(
        scorer=f"{user_file}:dispatch", num_workers=2, timeout_s=1.0, fallback_score=-5.0
    )
    with RewardManager(cfg, tok) as manager:
        yield manager


# ---- scorers --------------------------------------------------------------------------------


def test_gsm8k_spec003_values() -> None:
    good = "<think>3 + 5 = 8</think>\n<answer>8</answer>"
    out = gsm8k_score("gsm8k", good, "8")
    assert out == {
        "score": 2.25,
        "format_score": 1.25,
        "answer_score": 1.0,
        "extracted_answer": "8",
    }
    assert gsm8k_score("gsm8k", good.replace(">8<", ">9<"), "8")["score"] == 1.25
    assert gsm8k_score("gsm8k", "<answer> 1,234.0 </answer>", 1234)["score"] == 1.0
    assert (
        gsm8k_score("gsm8k", "<think>x</think><answer>$72</answer>", "so #### 72")["score"] == 2.25
    )
    missing = gsm8k_score("gsm8k", "the answer is 8", "8")
    assert missing["score"] == 0.0 and missing["extracted_answer"] is None
    assert gsm8k_score("gsm8k", "<think>a</think><answer>eight</answer>", "8")["score"] == 1.25
    # malformed: text after </answer>, a second answer block, unclosed think
    assert gsm8k_score("gsm8k", "<think>a</think><answer>8</answer> bye", "8")["score"] == 1.0
    two = "<think>a</think><answer>7</answer><answer>8</answer>"
    assert gsm8k_score("gsm8k", two, "8") == {
        "score": 1.0,
        "format_score": 0.0,
        "answer_score": 1.0,
        "extracted_answer": "8",
    }
    assert gsm8k_score("gsm8k", "<think>a<answer>8</answer>", "8")["format_score"] == 0.0
    custom = gsm8k_score("gsm8k", "nothing", "8", format_miss=-1.0, answer_miss=-1.0)
    assert custom["score"] == -2.0
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_score("gsm8k", good, "eight")


def test_reasoning_gym_scorer_uses_the_task_scorer() -> None:
    entry = reasoning_gym.create_dataset("chain_sum", size=1, seed=3)[0]
    info = {"rg_entry": json.loads(json.dumps(entry))}
    right = f"Adding up.\n<answer>{entry['answer']}</answer>"
    out = reasoning_gym_score("reasoning_gym/chain_sum", right, entry["answer"], info)
    assert out["answer_score"] == 1.0 and out["format_score"] == 1.0
    assert out["score"] == pytest.approx(1.1)
    assert out["extracted_answer"] == entry["answer"]
    wrong = reasoning_gym_score("reasoning_gym/chain_sum", "<answer>123456</answer>", "", info)
    assert wrong["score"] == pytest.approx(0.1) and wrong["answer_score"] == 0.0
    untagged = reasoning_gym_score(
        "reasoning_gym/chain_sum", f"so it is {entry['answer']}.", "", info
    )
    assert untagged == {
        "score": 0.5,
        "answer_score": 1.0,
        "format_score": 0.0,
        "extracted_answer": entry["answer"],
    }
    none = reasoning_gym_score(
        "reasoning_gym/chain_sum", entry["answer"], "", info, untagged_weight=0.0
    )
    assert none["score"] == 0.0 and none["extracted_answer"] is None
    words = reasoning_gym_score("reasoning_gym/chain_sum", "no idea", "", info)
    assert words["score"] == 0.0 and words["extracted_answer"] is None
    weighted = reasoning_gym_score(
        "reasoning_gym/chain_sum", right, "", info, answer_weight=2.0, format_weight=0.5
    )
    assert weighted["score"] == pytest.approx(2.5)
    think = reasoning_gym_score("reasoning_gym/chain_sum", right, "", info, require_think=True)
    assert think["format_score"] == 0.0
    # without rg_entry the ground truth is the reference answer
    bare = reasoning_gym_score("reasoning_gym/chain_sum", right, entry["answer"], None)
    assert bare["answer_score"] == 1.0


def test_math_scorer() -> None:
    assert math_score("math", "so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}")["score"] == 1.0
    assert math_score("math", "<answer>1/2</answer>", "\\frac{1}{2}")["score"] == 1.0
    assert math_score("math", "<answer>$\\sqrt{2}$</answer>", "\\sqrt{2}")["score"] == 1.0
    wrong = math_score("math", "the result is \\boxed{3}", "4")
    assert wrong["score"] == 0.0 and wrong["extracted_answer"] == "3"
    assert math_score("math", "no idea", "4")["score"] == 0.0


# ---- registry -------------------------------------------------------------------------------


def test_lookup_exact_then_prefix_and_unknown_error() -> None:
    assert get_scorer("gsm8k") is SCORERS["gsm8k"]
    assert scorer_spec("reasoning_gym/chain_sum") == "reasoning_gym"
    assert get_scorer("reasoning_gym/chain_sum") is reasoning_gym_score
    assert get_scorer("anything", "math") is math_score
    with pytest.raises(ValueError, match=r"'no_such_task'.*'gsm8k'.*'math'.*'reasoning_gym'"):
        get_scorer("no_such_task")
    with pytest.raises(ValueError, match="neither a registered name"):
        get_scorer("gsm8k", "nope")


def test_user_scorer_from_file(user_file: Path, tmp_path: Path) -> None:
    fn = get_scorer("whatever", f"{user_file}:other")
    assert fn("whatever", "text", 1) == 7
    with pytest.raises(UserCodeError, match=r"^reward\.scorer: .*missing\.py does not exist$"):
        get_scorer("x", f"{tmp_path}/missing.py:fn")
    with pytest.raises(UserCodeError, match=r"no function 'absent'.*\['dispatch', 'other'\]"):
        get_scorer("x", f"{user_file}:absent")


def test_registered_scorer_and_portable_spec(user_file: Path) -> None:
    @register_scorer("local_only")
    def local(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    try:
        assert get_scorer("local_only/sub") is local
        with pytest.raises(ValueError, match="not a top-level function"):
            portable_spec("local_only")
    finally:
        del SCORERS["local_only"]
    register_scorer("top_level")(gsm8k_score)
    try:
        assert portable_spec("top_level").endswith("scorers.py:gsm8k_score")
    finally:
        del SCORERS["top_level"]
    assert portable_spec("gsm8k") == "gsm8k"
    assert portable_spec(f"{user_file}:other") == f"{user_file.resolve()}:other"


# ---- wire protocol --------------------------------------------------------------------------


def test_wire_is_json_lines_never_pickle() -> None:
    for module in (worker, pool):
        assert "pickle" not in inspect.getsource(module)
    proc = subprocess.run(
        [sys.executable, "-m", "creditrl.rewards.worker"],
        input=json.dumps(
            {
                "id": 5,
                "scorer": "gsm8k",
                "scorer_kwargs": {},
                "data_source": "gsm8k",
                "solution_str": "<think>a</think><answer>8</answer>",
                "ground_truth": "8",
                "extra_info": {},
            }
        )
        + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(pool.__file__).parents[2])},
    )
    ready, reply = (json.loads(line) for line in proc.stdout.splitlines())
    assert proc.returncode == 0  # exits on stdin EOF
    assert ready["ready"] is True
    assert reply["id"] == 5 and reply["status"] == "ok" and reply["score"] == 2.25
    assert reply["extra"]["format_score"] == 1.25 and reply["error"] is None


# ---- reward manager -------------------------------------------------------------------------


def test_manager_in_process_builtin_scorers(tok) -> None:
    entry = json.loads(json.dumps(reasoning_gym.create_dataset("chain_sum", size=1, seed=0)[0]))
    texts = [
        "<think>ok</think><answer>8</answer>",
        "no tags",
        f"<answer>{entry['answer']}</answer>",
    ]
    batch = make_batch(
        tok,
        texts,
        ["8", "8", entry["answer"]],
        ["gsm8k", "gsm8k", "reasoning_gym/chain_sum"],
        [{}, {}, {"rg_entry": entry}],
        eos=[True, False, True],
    )
    with RewardManager(RewardConfig(num_workers=0), tok) as manager:
        result = manager(batch)
    assert result.scores.tolist() == pytest.approx([2.25, 0.0, 1.1])
    last = batch["response_mask"].sum(-1) - 1
    expected = torch.zeros_like(result.token_level_scores)
    expected[torch.arange(3), last] = result.scores
    assert result.token_level_scores.dtype == torch.float32
    assert torch.equal(result.token_level_scores, expected)
    assert result.extra["reward_status"] == ["ok", "ok", "ok"]
    assert result.extra["extracted_answer"] == ["8", None, entry["answer"]]
    assert result.metrics["reward/errors"] == 0
    assert result.metrics["reward/score_mean"] == pytest.approx((2.25 + 1.1) / 3)
    assert result.metrics["reward/answer_score_mean"] == pytest.approx(2 / 3)
    result.write_to(batch)
    assert batch["reward_extra_info"][0]["format_score"] == 1.25
    assert torch.equal(batch["token_level_scores"], result.token_level_scores)


def test_manager_worker_pool_end_to_end(pool_manager, tok) -> None:
    texts = ["abc", "PRINT", "hello world"]
    batch = make_batch(tok, texts, [1, {"k": [1, 2]}, "x"])
    result = pool_manager(batch)
    assert result.scores.tolist() == [3.0, 5.0, 11.0]
    assert result.extra["echo"] == [1, {"k": [1, 2]}, "x"]
    assert result.extra["reward_status"] == ["ok"] * 3
    rows, cols = result.token_level_scores.nonzero(as_tuple=True)
    assert rows.tolist() == [0, 1, 2]
    assert cols.tolist() == [len(t) for t in texts]  # the EOS after the text's bytes
    assert result.metrics["reward/score_mean"] == pytest.approx(19 / 3)


def test_submit_returns_at_once(pool_manager, tok) -> None:
    batch = make_batch(tok, ["SLEEP a", "SLEEP b"], [0, 0])
    future = pool_manager.submit(batch)
    assert not future.done()
    assert future.result(timeout=30).scores.tolist() == [7.0, 7.0]


def test_scorer_error_gives_fallback_and_message(pool_manager, tok) -> None:
    result = pool_manager(make_batch(tok, ["fine", "RAISE"], [0, 0]))
    assert result.scores.tolist() == [4.0, -5.0]
    assert result.extra["reward_status"] == ["ok", "error"]
    assert result.extra["reward_error"][0] is None
    assert "ValueError: scorer exploded on purpose" in result.extra["reward_error"][1]
    assert result.metrics["reward/errors"] == 1 and result.metrics["reward/timeouts"] == 0


def test_nan_score_gives_fallback(pool_manager, tok) -> None:
    result = pool_manager(make_batch(tok, ["NAN", "ok"], [0, 0]))
    assert result.scores.tolist() == [-5.0, 2.0]
    assert result.extra["reward_status"] == ["nan", "ok"]
    assert result.metrics["reward/nan"] == 1 and result.metrics["reward/errors"] == 0
    assert torch.isfinite(result.token_level_scores).all()


def test_hanging_scorer_times_out_and_worker_is_replaced(pool_manager, tok) -> None:
    result = pool_manager(make_batch(tok, ["HANG", "fast"], [0, 0]))
    assert result.scores.tolist() == [-5.0, 4.0]
    assert result.extra["reward_status"] == ["timeout", "ok"]
    assert result.metrics["reward/timeouts"] == 1
    again = pool_manager(make_batch(tok, ["abcd", "ab", "a"], [0, 0, 0]))
    assert again.scores.tolist() == [4.0, 2.0, 1.0]


def test_in_process_mode_runs_a_locally_registered_scorer(tok) -> None:
    @register_scorer("local_task")
    def local(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        return {"score": float(solution_str == ground_truth) + bonus, "seen": extra_info["k"]}

    try:
        cfg = RewardConfig(num_workers=0, scorer_kwargs={"bonus": 0.5})
        with RewardManager(cfg, tok) as manager:
            result = manager(
                make_batch(tok, ["yes", "no"], ["yes", "yes"], "local_task/a", [{"k": 1}, {"k": 2}])
            )
    finally:
        del SCORERS["local_task"]
    assert result.scores.tolist() == [1.5, 0.5]
    assert result.extra["seen"] == [1, 2]


def test_bad_inputs_raise_naming_the_sample(tok) -> None:
    with RewardManager(RewardConfig(num_workers=0), tok) as manager:
        with pytest.raises(TypeError, match="sample 1: ground_truth"):
            manager.submit(make_batch(tok, ["a", "b"], ["8", {1, 2}], "gsm8k"))
        with pytest.raises(ValueError, match="'mystery'"):
            manager.submit(make_batch(tok, ["a"], ["8"], "mystery"))


@pytest.fixture(scope="module")
def local_manager(tok, user_file):
    """``my_scorers.py:dispatch`` scored in this process (num_workers=0)."""
    cfg = RewardConfig(
        scorer=f"{user_file}:dispatch", num_workers=0, timeout_s=30.0, fallback_score=-5.0
    )
    with RewardManager(cfg, tok) as manager:
        yield manager


@pytest.mark.parametrize("where", ["pool_manager", "local_manager"])
def test_scores_beyond_float32_are_counted_like_nan(where, request, tok) -> None:
    """1e300, -1e39 and a sub-metric of 1e300 give the fallback, status "nan" and a count;
    the batch's scores stay finite (they used to become inf in float32)."""
    manager = request.getfixturevalue(where)
    texts = ["BIG", "NEG", "SUBMETRIC", "ok", "okay", "fine!"]
    result = manager.submit(make_batch(tok, texts, [0] * 6)).result(timeout=60)
    assert result.extra["reward_status"] == ["nan"] * 3 + ["ok"] * 3
    assert result.scores.tolist() == [-5.0, -5.0, -5.0, 2.0, 4.0, 5.0]
    assert torch.isfinite(result.token_level_scores).all()
    errors = result.extra["reward_error"]
    assert "1e+300" in errors[0] and "-1e+39" in errors[1] and "'acc'" in errors[2]
    assert result.metrics["reward/nan"] == 3 and result.metrics["reward/errors"] == 0
    assert "reward/acc_mean" not in result.metrics


@pytest.mark.parametrize("where", ["pool_manager", "local_manager"])
def test_deep_or_huge_results_are_refused_with_a_reason(where, request, tok) -> None:
    """A result nested 100000 deep, a list of 10**7 values or a 100 MB string is a failed
    sample naming the bound, not a RecursionError, a dead pool thread or a 100 MB line."""
    manager = request.getfixturevalue(where)
    texts = ["DEEP", "LONGLIST", "HUGESTR", "ok", "okay", "fine!"]
    result = manager.submit(make_batch(tok, texts, [0] * 6)).result(timeout=60)
    assert result.extra["reward_status"] == ["error"] * 3 + ["ok"] * 3
    assert result.scores.tolist() == [-5.0, -5.0, -5.0, 2.0, 4.0, 5.0]
    deep, many, text = result.extra["reward_error"][:3]
    assert "nested deeper than 32 levels" in deep
    assert "more than 10000 values" in many
    assert "more than 262144 bytes" in text
    assert result.metrics["reward/errors"] == 3


def test_in_process_timeout_abandons_the_thread_and_bounds_them(tok, monkeypatch) -> None:
    """num_workers=0 enforces timeout_s: a hung scorer's sample times out and its thread is
    abandoned; with MAX_ABANDONED of them running, further samples fail at once; once they
    end, scoring resumes. A scorer calling sys.exit is an error, not a dead pool thread."""
    release = threading.Event()

    @register_scorer("hangs")
    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "EXIT":
            sys.exit(3)
        if solution_str == "HANG":
            release.wait(60)  # released by the test; 60 s only guards against a hang
        return float(len(solution_str))

    monkeypatch.setattr(inprocess, "MAX_ABANDONED", 2)
    cfg = RewardConfig(num_workers=0, timeout_s=1.5, fallback_score=-5.0, max_failure_rate=1.0)
    texts = ["EXIT", "HANG", "ab", "HANG", "abc"]
    try:
        with RewardManager(cfg, tok) as manager:
            result = manager.submit(make_batch(tok, texts, [0] * 5, "hangs")).result(timeout=30)
            assert result.extra["reward_status"] == ["error", "timeout", "ok", "timeout", "error"]
            assert result.scores.tolist() == [-5.0, -5.0, 2.0, -5.0, -5.0]
            errors = result.extra["reward_error"]
            assert errors[0].startswith("SystemExit: 3")
            assert "exceeded 1.5s" in errors[1] and "abandoned" in errors[1]
            assert "2 in-process scorer threads" in errors[4] and "num_workers" in errors[4]
            assert result.metrics["reward/timeouts"] == 2 and result.metrics["reward/errors"] == 2
            release.set()
            for thread in manager.pool.in_process.abandoned:
                thread.join(60)
                assert not thread.is_alive()
            again = manager.submit(make_batch(tok, ["abcd"], [0], "hangs")).result(timeout=30)
            assert again.extra["reward_status"] == ["ok"] and again.scores.tolist() == [4.0]
    finally:
        release.set()
        del SCORERS["hangs"]


# A stand-in worker process that answers each request by its solution_str with a bad line.
FAKE_WORKER = textwrap.dedent(
    """
    import json, sys
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        rid, kind = request["id"], request["solution_str"]
        reply = {"id": rid, "status": "ok", "score": 2.0, "extra": {"k": 1}, "error": None}
        if kind == "long":
            out = json.dumps({**reply, "extra": {"s": "x" * 400_000}})
        elif kind == "deep_json":
            out = "[" * 100_000 + "]" * 100_000
        elif kind == "deep_extra":
            out = json.dumps(reply)[:-1] + ', "extra": ' + '{"a": ' * 40 + "1" + "}" * 41
        elif kind == "not_json":
            out = "hello"
        elif kind == "str_score":
            out = json.dumps({**reply, "score": "high"})
        elif kind == "inf_score":
            out = json.dumps({**reply, "score": 1e300})
        elif kind == "huge_int":
            out = json.dumps({**reply, "extra": {"n": 10**400}})
        else:
            out = json.dumps(reply)
        sys.stdout.write(out + "\\n")
        sys.stdout.flush()
    """
)


def test_worker_replies_are_bounded_and_checked_in_the_parent(monkeypatch) -> None:
    """A worker's reply line is bounded before json.loads, its nesting and fields checked: each
    bad reply is a failed sample with its reason (the worker replaced), and scoring goes on."""
    monkeypatch.setattr(pool, "WORKER_COMMAND", [sys.executable, "-c", FAKE_WORKER])
    kinds = ["long", "deep_json", "deep_extra", "not_json", "str_score", "inf_score"]
    kinds += ["huge_int", "good"]
    scoring = pool.ScoringPool(1, 30.0)
    try:
        job = pool.ScoringJob(len(kinds))
        for i, kind in enumerate(kinds):
            scoring.put(job, i, 1000 + i, json.dumps({"id": 1000 + i, "solution_str": kind}) + "\n")
        assert job.wait(60), "the pool stopped answering"
    finally:
        scoring.close()
    replies = dict(zip(kinds, job.replies, strict=True))
    assert replies["good"] == {"status": "ok", "score": 2.0, "extra": {"k": 1}, "error": None}
    expected = {
        "long": ("error", "longer than 278528 characters"),
        "deep_json": ("error", "nested too deeply"),
        "deep_extra": ("error", "nested deeper than 32 levels"),
        "not_json": ("error", "not JSON"),
        "str_score": ("error", "score 'high' is not a number"),
        "inf_score": ("nan", "1e+300"),
        "huge_int": ("nan", "'n'"),
    }
    for kind, (status, reason) in expected.items():
        assert replies[kind]["status"] == status, (kind, replies[kind])
        assert reason in replies[kind]["error"], (kind, replies[kind])
        assert replies[kind]["score"] is None


# ---- reward model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory, tok) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=PAD,
    )
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_reward_model_worker_shapes(rm_dir: Path, tok) -> None:
    rm = RewardModelWorker(
        RewardModelConfig(enable=True, path=str(rm_dir), micro_batch_size=2), tok
    )
    batch = make_batch(
        tok, ["one", "a longer answer", "mid one"], [0, 0, 0], eos=[True, False, True]
    )
    rm_scores = rm.compute_rm_score(batch)
    assert rm_scores.shape == batch["responses"].shape and rm_scores.dtype == torch.float32
    last = batch["response_mask"].sum(-1) - 1
    assert (rm_scores.count_nonzero(dim=-1) == 1).all()
    single = []
    for i, text in enumerate(["one", "a longer answer", "mid one"]):
        conv = [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": text},
        ]
        ids = tok(tok.apply_chat_template(conv, tokenize=False), return_tensors="pt")
        with torch.no_grad():
            single.append(float(rm.model(**ids).logits[0, 0]))
    torch.testing.assert_close(rm_scores[torch.arange(3), last], torch.tensor(single))


def test_manager_combines_reward_model(rm_dir: Path, tok) -> None:
    texts = ["<think>t</think><answer>8</answer>", "<answer>3</answer>"]
    batch = make_batch(tok, texts, ["8", "8"], "gsm8k")
    rm_cfg = RewardModelConfig(enable=True, path=str(rm_dir), mode="add")
    with RewardManager(RewardConfig(num_workers=0, reward_model=rm_cfg), tok) as manager:
        added = manager(batch)
    rm_only = added.extra["rm_score"]
    assert added.scores.tolist() == pytest.approx([2.25 + rm_only[0], 0.0 + rm_only[1]])
    assert added.rm_scores is not None and added.rm_scores.shape == added.token_level_scores.shape
    rm_cfg.mode = "replace"
    del batch["data_source"]  # replace mode needs no rule scorer
    with RewardManager(RewardConfig(num_workers=0, reward_model=rm_cfg), tok) as manager:
        replaced = manager(batch)
    assert replaced.scores.tolist() == pytest.approx(rm_only)
    assert math.isclose(replaced.metrics["reward/rm_score_mean"], sum(rm_only) / 2, rel_tol=1e-5)


@pytest.mark.parametrize("workers", [0, 1])
def test_program_rewards_need_no_data_source_scorer(tok, workers) -> None:
    """Rows an agent.program scored (``extra_info["program_reward"]``, a float or a scorer
    dict) are scored by it, in worker processes or in this one, even for a data_source no
    scorer is registered for (before: a DataError before any row was scored)."""
    cfg = RewardConfig(num_workers=workers, timeout_s=30.0)
    infos = [{"program_reward": 0.75}, {"program_reward": {"score": -1.0, "turns": 2}}]
    with RewardManager(cfg, tok) as manager:
        result = manager(make_batch(tok, ["a", "b"], [None, None], "calc_multiturn", infos))
    assert result.scores.tolist() == [0.75, -1.0]
    assert result.extra["reward_status"] == ["ok", "ok"]
    assert result.extra["turns"] == [None, 2]


def test_reward_model_directory_passes_the_model_directory_checks(
    rm_dir: Path, tok, tmp_path: Path
) -> None:
    """The reward model's directory is checked like the actor's: pickle weights are one line
    and never unpickled (before, transformers read pytorch_model.bin)."""
    hostile = tmp_path / "rm"
    shutil.copytree(rm_dir, hostile)
    (hostile / "model.safetensors").unlink()
    (hostile / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    with pytest.raises(ModelError, match="safetensors"):
        RewardModelWorker(RewardModelConfig(enable=True, path=str(hostile)), tok)
