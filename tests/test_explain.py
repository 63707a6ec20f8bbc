"""``creditrl explain``: the spec 000 example printed exactly, views of a rollout dump (with
observation spans and turns), views computed from a prompt with a model, clip flags, errors."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from creditrl.batch import Batch
from creditrl.cli import main
from creditrl.config.loader import load_config
from creditrl.core import (
    PolicyLossConfig,
    compute_gae_advantage_return,
    compute_policy_loss_ppo,
)
from creditrl.inspect.columns import COLUMNS, header
from creditrl.inspect.compute import Settings, clip_flags
from creditrl.inspect.from_run import views_from_run
from creditrl.inspect.from_text import views_from_text
from creditrl.inspect.view import token_text
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.tracking.rollout_dump import RolloutDumper

REWARDS = ["-0.010000", "-0.005000", "+0.005000", "-0.010000", "-0.020000", "+0.995000"]
VALUES = ["+0.200000", "+0.250000", "+0.300000", "+0.350000", "+0.450000", "+0.600000"]
RAW_ADV = ["+0.621081", "+0.611664", "+0.596488", "+0.569987", "+0.505250", "+0.395000"]
RETURNS = ["+0.821081", "+0.861664", "+0.896488", "+0.919987", "+0.955250", "+0.995000"]


def parse_tables(text: str) -> dict[str, list[str]]:
    """{header: cells by row} from rich tables; a table continued in a second part repeats its
    t and y_t columns, which are read once."""
    columns: dict[str, list[str]] = {}
    current: list[str] = []
    repeated: set[str] = set()
    for line in text.splitlines():
        if "┃" in line:
            current = [c.strip() for c in line.strip().strip("┃").split("┃")]
            repeated = {n for n in current if columns.get(n)}
            for name in current:
                columns.setdefault(name, [])
        elif "│" in line and current:
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            for name, cell in zip(current, cells, strict=True):
                if name not in repeated:
                    columns[name].append(cell)
    return columns


def test_example_prints_exactly_the_spec000_numbers(capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--example"]) == 0
    out = capsys.readouterr().out
    cols = parse_tables(out)
    assert cols["r_t"] == REWARDS
    assert cols["V(s_t)"] == VALUES
    assert cols["A_raw"] == RAW_ADV
    assert cols["R_t"] == RETURNS
    assert cols["score_t"] == ["+0.000000"] * 5 + ["+1.000000"]
    assert cols["kl_t"] == [f"{x:+.6f}" for x in (0.1, 0.05, -0.05, 0.1, 0.2, 0.05)]
    assert cols["δ_t"] == [f"{x:+.6f}" for x in (0.04, 0.045, 0.055, 0.09, 0.13, 0.395)]
    whitened = [float(x) for x in cols["A_t"]]
    assert abs(sum(whitened)) < 1e-5
    for name in ("reward", "value", "delta", "advantage_raw", "return", "advantage"):
        assert f"{header(name)} [{name}]: {COLUMNS[name].meaning}" in re.sub(r"\s+", " ", out)
    assert "Row t is step t = tensor column j + 1" in re.sub(r"\s+", " ", out)


def test_example_tsv_and_narrow_console_keep_the_numbers(capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--example", "--tsv", "--columns", "reward,return"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t") == ["row", "t", "token", "reward", "return"]
    assert [line.split("\t")[3] for line in lines[1:]] == REWARDS
    assert [line.split("\t")[4] for line in lines[1:]] == RETURNS
    from rich.console import Console

    from creditrl.inspect.example import example_view
    from creditrl.inspect.table import print_views

    console = Console(width=70, record=True)
    print_views([example_view()], console, legend=False)
    cols = parse_tables(console.export_text())
    assert cols["A_raw"] == RAW_ADV and cols["R_t"] == RETURNS


def test_token_text_maps_byte_level_pieces() -> None:
    assert token_text("Ġthe") == " the"
    assert token_text("Ċ") == "\n"
    assert token_text("æĺ¯") == "是"
    assert token_text("æĺ") == "\\xe6\\x98"  # half a character shows its bytes
    assert token_text("▁hello") == " hello"
    assert token_text("<|im_end|>") == "<|im_end|>"


def _dump_batch(tokenizer) -> Batch:
    """Two responses: row 0 multi-turn with an observation span (mask 0 at columns 2-3), row 1
    shorter (padding after column 3)."""
    prompts = torch.tensor([[2, 504, 1032], [504, 1032, 2049]])
    responses = torch.tensor([[330, 331, 332, 333, 334, 335], [440, 441, 442, 443, 2, 2]])
    resp_attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]])
    attn = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), resp_attn], dim=1)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 6, generator=g) * mask
    ref = old - 0.1 * torch.rand(2, 6, generator=g) * mask
    values = torch.rand(2, 6, generator=g) * mask
    scores = torch.zeros(2, 6)
    scores[0, 5], scores[1, 3] = 1.0, 0.5
    rewards = (scores - 0.05 * (old - ref)) * mask
    adv, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.9)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attn,
            "response_mask": mask,
            "turn_ids": torch.tensor([[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 0, 0]]),
            "old_log_probs": old,
            "ref_log_prob": ref,
            "values": values,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": adv,
            "returns": returns,
        },
        {"uid": ["a", "a"], "data_source": ["toy", "toy"], "ground_truth": ["1", "1"]},
    )


@pytest.fixture(scope="module")
def dump_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Batch]:
    run = tmp_path_factory.mktemp("run")
    tokenizer = load_tokenizer(tiny_model_dir())
    batch = _dump_batch(tokenizer)
    RolloutDumper(run, rows_per_step=2, tokenizer=tokenizer).dump(batch, step=4)
    (run / "metrics.jsonl").write_text('{"step": 4, "actor/reward_kl_penalty_coeff": 0.05}\n')
    return run, batch


PPO = ["preset=ppo", "algorithm.lam=0.9"]


def test_run_dump_views_show_the_stored_tensors_and_derive_the_rest(dump_run) -> None:
    run, batch = dump_run
    views = views_from_run(run, overrides=PPO)
    assert [len(v.tokens) for v in views] == [6, 4]
    mask = batch["response_mask"]
    for i, view in enumerate(views):
        n = len(view.tokens)
        assert view.columns["id"] == batch["responses"][i, :n].tolist()
        assert view.columns["mask"] == mask[i, :n].tolist()
        assert view.columns["turn"] == batch["turn_ids"][i, :n].tolist()
        for column, field in [("reward", "token_level_rewards"), ("advantage", "advantages")]:
            assert view.columns[column] == pytest.approx(batch[field][i, :n].tolist(), abs=1e-6)
        assert view.settings["beta"] == 0.05 and view.settings["step"] == 4
    raw, _ = compute_gae_advantage_return(
        batch["token_level_rewards"].double(), batch["values"].double(), mask, 1.0, 0.9,
        whiten=False,
    )  # fmt: skip
    deltas, _ = compute_gae_advantage_return(
        batch["token_level_rewards"].double(), batch["values"].double(), mask, 1.0, 0.0,
        whiten=False,
    )  # fmt: skip
    for i, view in enumerate(views):
        n = len(view.tokens)
        assert view.columns["advantage_raw"] == pytest.approx(raw[i, :n].tolist(), abs=1e-5)
        assert view.columns["delta"] == pytest.approx(deltas[i, :n].tolist(), abs=1e-5)
    # the observation span is not a time step: δ at column 1 looks past it to column 4
    r, v = batch["token_level_rewards"][0], batch["values"][0]
    assert views[0].columns["delta"][1] == pytest.approx(float(r[1] + v[4] - v[1]), abs=1e-5)
    assert views[0].columns["delta"][2:4] == [0.0, 0.0]
    kl = (batch["old_log_probs"] - batch["ref_log_prob"])[0].tolist()
    assert views[0].columns["kl"] == pytest.approx(kl, abs=1e-5)
    notes = " ".join(views[0].notes)
    assert "no config.yaml" in notes and "differ" not in notes


def test_run_dump_with_the_wrong_settings_says_so(dump_run) -> None:
    run, _ = dump_run
    notes = " ".join(views_from_run(run, overrides=["preset=ppo", "algorithm.lam=0.5"])[0].notes)
    assert "returns recomputed with gamma=1.0, lam=0.5 differ" in notes
    notes = " ".join(
        views_from_run(run, overrides=["preset=ppo", "algorithm.kl_penalty=k3"])[0].notes
    )
    assert "stored rewards differ from score - beta*kl" in notes


def test_cli_run_dir_with_options_after_overrides(dump_run, capsys: pytest.CaptureFixture) -> None:
    run, batch = dump_run
    html_file = run / "explain.html"
    code = main(["explain", str(run), *PPO, "--row", "1", "--tsv", "--html", str(html_file)])
    assert code == 0
    out = capsys.readouterr().out
    lines = [line.split("\t") for line in out.splitlines() if "\t" in line]
    head = lines[0]
    assert head[:5] == ["row", "t", "token", "id", "mask"]
    rows = lines[1:]
    assert [int(r[head.index("id")]) for r in rows] == batch["responses"][1, :4].tolist()
    assert [r[head.index("score")] for r in rows][-1] == "+0.500000"
    page = html_file.read_text()
    assert page.count('class="tok"') == 4 and "<script" in page
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//|<link|@import", page)


def test_clip_flags_match_the_core_loss_metrics() -> None:
    old = torch.zeros(1, 6)
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5, 4.0, 1.1]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0, 1.0]])
    t = {"old_log_prob": old, "log_prob": ratios.log(), "advantage": adv, "mask": torch.ones(1, 6)}
    flags = clip_flags(t, Settings(policy_loss="ppo", clip=PolicyLossConfig(clip_ratio_c=3.0)))
    # A>0 & r>1+eps, A<0 & r<1-eps: clipped; A<0 & r>c: dual clip; inside the region: not
    assert flags.tolist() == [[1, 0, 1, 0, 1, 0]]
    _, metrics = compute_policy_loss_ppo(old, ratios.log(), adv, torch.ones(1, 6))
    expected = float(metrics["pg_clipfrac"] + metrics["pg_clipfrac_lower"])
    assert flags.float().mean().item() == pytest.approx(expected)


def test_prompt_and_responses_computed_with_a_model() -> None:
    cfg = load_config(None, [f"model.path={tiny_model_dir()}"])
    views = views_from_text(
        "What is 2+3?",
        ["<answer>5</answer>", "It is 6"],
        cfg,
        ground_truth="5",
        data_source="reasoning_gym/chain_sum",
        theta=str(tiny_model_dir()),
    )
    assert [v.tokens[-1] for v in views] == ["<|im_end|>", "<|im_end|>"]
    good, bad = views
    assert good.columns["score"][-1] > 0.9 and bad.columns["score"][-1] == 0.0
    assert good.columns["advantage"][0] == pytest.approx(1 / math.sqrt(2), abs=1e-4)
    assert bad.columns["advantage"][0] == pytest.approx(-1 / math.sqrt(2), abs=1e-4)
    assert all(lp < 0 for lp in good.columns["old_log_prob"])
    assert good.columns["ratio"] == pytest.approx([1.0] * len(good.tokens), abs=1e-5)
    assert set(good.columns["clipped"]) == {0}
    assert "by the reasoning_gym/chain_sum scorer" in good.notes[0]


def test_prompt_mode_ppo_uses_a_critic_and_the_kl(capsys: pytest.CaptureFixture) -> None:
    code = main([
        "explain", "--prompt", "2+2?", "--response", "4", "--score", "1",
        f"model.path={tiny_model_dir()}", "preset=ppo", "algorithm.lam=0.95", "--tsv",
    ])  # fmt: skip
    assert code == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines() if "\t" in line]
    head, rows = lines[0], lines[1:]
    for name in ("old_log_prob", "ref_log_prob", "kl", "value", "delta", "advantage_raw"):
        assert name in head
    assert {r[head.index("kl")] for r in rows} == {"+0.000000"}
    assert {r[head.index("value")] for r in rows} == {"+0.000000"}  # fresh zero-head critic
    # "4" then EOS, V = 0, score 1 on EOS: A_2 = 1, A_1 = gamma * lam * A_2 = 0.95
    assert [r[head.index("advantage_raw")] for r in rows] == ["+0.950000", "+1.000000"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--step", "9"], "has no rollout dump for step 9"),
        (["--row", "7"], "rows [7] have no per-token dump"),
        (["--prompt", "hi"], "--prompt needs at least one --response"),
        (["algorithm.lam=0.5"], None),
    ],
)
def test_errors_name_the_problem(
    dump_run, capsys: pytest.CaptureFixture, argv: list[str], message: str | None
) -> None:
    run, _ = dump_run
    items = argv if argv[0] == "--prompt" else [str(run), *argv]
    code = main(["explain", *items])
    if message is None:
        assert code == 0
        return
    assert code == 2
    assert message in re.sub(r"\s+", " ", capsys.readouterr().out)


def test_no_source_and_missing_ground_truth(capsys: pytest.CaptureFixture, tmp_path) -> None:
    """No source is an error; a prompt without --ground-truth or --score now runs with score 0
    and says so (it used to stop, so the README's example failed as written)."""
    assert main(["explain"]) == 2
    assert "give RUN_DIR" in capsys.readouterr().out
    code = main(["explain", "--prompt", "x", "--response", "y", f"model.path={tiny_model_dir()}"])
    assert code == 0
    assert "no --ground-truth or --score" in re.sub(r"\s+", " ", capsys.readouterr().out)


def test_readme_explain_example_runs_as_written(tmp_path, monkeypatch) -> None:
    """The README's ``creditrl explain --prompt ... --html`` line runs (on the tiny model) and
    writes its page."""
    import shlex

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("creditrl explain --prompt"))
    argv = shlex.split(line.split("#")[0])[1:]
    monkeypatch.chdir(tmp_path)
    assert main([*argv, f"model.path={tiny_model_dir()}"]) == 0
    html = argv[argv.index("--html") + 1]
    assert (tmp_path / html).stat().st_size > 1000


def test_a_page_stays_a_page_whatever_the_text(tmp_path: Path) -> None:
    """Text that would end or unbalance the page's script element ("</script>", "<!--<script>")
    or inject markup: the JSON inside the script holds no "<" at all, decodes to the texts as
    they were, and the page ends with its own closing tags."""
    hostile = "<!--<script> </script><img src=x onerror=alert(1)> & \u2028 </SCRIPT >"
    page = tmp_path / "x.html"
    args = ["explain", "--prompt", hostile, "--response", hostile, "--ground-truth", hostile,
            "--html", str(page), f"model.path={tiny_model_dir()}"]  # fmt: skip
    assert main(args) == 0
    text = page.read_text()
    start = text.index('<script type="application/json" id="explain-data">')
    body = text[start:].split(">", 1)[1]
    data, rest = body.split("</script>", 1)
    assert "<" not in data
    assert rest.startswith("<script>") and rest.endswith("</script></body></html>")
    assert rest.count("</script>") == 1 and "<img" not in text
    decoded = json.dumps(json.loads(data), ensure_ascii=False)
    assert "onerror=alert(1)" in decoded and "<!--<script>" in decoded
