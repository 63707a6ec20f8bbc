"""``creditrl check-tokenization``: spec 004's drift detectors on a model, dataset and tools.

    creditrl check-tokenization [CONFIG.yaml] [key=value ...] [--rows N] [--greedy] [--strict]
    creditrl check-tokenization --demo [--strict]

The first form rolls out the first ``--rows`` training prompts of the run (its datasets: the
data section's, an agent task's or an environment's) as its trainer would (the engine
``rollout.engine`` names, with the selected rollout strategy around it: the agent loop with its
``agent.*`` settings, ``agent.program``, or an environment; a single-turn config is refused)
and checks every trajectory: re-tokenization (``encode(decode(ids)) == ids``) and template
(``chat template over the final messages == accumulated ids``). ``--demo`` needs no model: it
forces two calculator trajectories through the loop, one canonical and one whose answer turn
writes "<think>" as the non-canonical ids "<", "th", "ink", ">", and checks both. Each
mismatch is shown with its first divergence, both spans decoded. ``--strict`` exits 1 when any
check finds a mismatch (for CI).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from creditrl.plain_text import as_text

__all__ = ["demo_batch", "demo_scripts", "register", "run"]


def _describe(found: Any) -> Text:
    if found is None:
        return Text("ok", style="green")
    if found == "skipped":
        return Text("skipped")
    a, b = [k for k in found if k.endswith("_tokens")]
    return Text.assemble(
        ("mismatch", "red"),
        as_text(f" at id {found['index']}: {found[a][:4]} vs {found[b][:4]}"),
    )


def demo_scripts(tokenizer: Any) -> list[list[list[int]]]:
    """The demo's two trajectories as model turns (ids): a calculator call, then the answer
    written canonically, or with "<think>" as the non-canonical ids "<", "th", "ink", ">"."""
    eos = tokenizer.eos_token_id
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>'
    turn1 = [*tokenizer.encode(call, add_special_tokens=False), eos]
    canonical = [*tokenizer.encode("<think>easy</think><answer>84</answer>"), eos]
    vocab = tokenizer.get_vocab()
    pieces = ["<", "th", "ink", ">"]
    if not all(p in vocab for p in pieces):
        raise ValueError(f"this tokenizer lacks one of {pieces}; the demo needs them")
    odd = [vocab[p] for p in pieces] + tokenizer.encode("easy</think><answer>84</answer>")
    return [[turn1, canonical], [turn1, [*odd, eos]]]


def demo_batch(tokenizer: Any) -> Any:
    """Two forced calculator trajectories (canonical, and a non-canonical "<think>" path)."""
    from creditrl.agents.rollout import AgentRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator
    from creditrl.config.schema import AgentConfig, RolloutConfig
    from creditrl.data import chat_prompt_ids, collate_prompts

    messages = [
        {"role": "system", "content": "Use the calculator tool, then answer in <answer></answer>."},
        {"role": "user", "content": "What is 12 * 7?"},
    ]
    row = {
        "input_ids": chat_prompt_ids(tokenizer, messages),
        "raw_prompt": messages,
        "ground_truth": "84",
        "data_source": "calc_multiturn",
        "extra_info": {},
        "index": 0,
    }
    rollout = AgentRollout(
        None,
        tokenizer,
        AgentConfig(enable=True, tools=["calculator"]),
        RolloutConfig(max_response_length=256),
        turn_generator=ScriptedTurnGenerator(demo_scripts(tokenizer), [tokenizer.eos_token_id]),
    )
    return rollout.generate(collate_prompts([row, row], tokenizer.pad_token_id)), rollout


def _model_batch(cfg: Any, rows: int, greedy: bool) -> tuple[Any, Any]:
    """The first ``rows`` training prompts of the run ``cfg`` describes, rolled out as its
    trainer would: its datasets (``build_run_datasets``: an environment's, an agent task's or
    the data section's) and a rollout-only worker's engine with the selected rollout strategy
    around it (``HybridWorker``: ``rollout.engine``, ``rollout.strategy``, ``agent.program``,
    ``env.*``); with the chat format its drift checks use."""
    from creditrl.agents.hooks import chat_format
    from creditrl.data import collate_prompts
    from creditrl.pipeline.step import build_run_datasets
    from creditrl.workers.hybrid import HybridWorker

    worker = HybridWorker(cfg, roles=("rollout",), with_teacher=False)
    try:
        train, _ = build_run_datasets(cfg, worker.tokenizer)
        picked = [train[i] for i in range(min(rows, len(train)))]
        prompts = collate_prompts(picked, worker.tokenizer.pad_token_id)
        batch = worker.generate(prompts, greedy=greedy)
    finally:
        close = getattr(worker.rollout, "close", None)  # agent.program, env.*: the endpoint
        if close is not None:
            close()
    return batch, chat_format(worker.tokenizer, cfg.agent.tool_role)


def single_turn_note(cfg: Any) -> str | None:
    """The line said when ``cfg``'s rollout samples one answer per prompt (no trajectory to
    check): the command then checks the built-in agent loop's, as ``agent.enable=true``
    would sample; None for a multi-turn strategy, which is checked as it is."""
    from creditrl.rollout.strategies import rollout_strategy, strategy_traits

    if strategy_traits(cfg).multi_turn:
        return None
    return (
        f"note: this config's rollout strategy is {rollout_strategy(cfg)} (one answer per "
        "prompt); checking the trajectories of the built-in agent loop (agent.enable=true)"
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl check-tokenization``."""
    from creditrl.agents.drift import check_batch
    from creditrl.config.loader import ConfigError, load_config
    from creditrl.models import load_tokenizer, resolve_model_path

    items = list(args.args)
    config_file = Path(items.pop(0)) if items and "=" not in items[0] else None
    try:
        cfg = load_config(config_file, items)
    except ConfigError as err:
        console.print("[red]config error:[/red]", as_text(err))
        return 2
    if args.demo:
        path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        batch, rollout = demo_batch(load_tokenizer(path))
        chat = rollout.loop.chat
    else:
        single = single_turn_note(cfg)
        if single is not None:
            console.print(as_text(single))
            cfg.rollout.strategy = "agent_loop"
        batch, chat = _model_batch(cfg, args.rows, args.greedy)
    metrics, reports = check_batch(batch, chat)
    table = Table(title="tokenization drift (spec 004)")
    for column in ("row", "turns", "tool calls", "re-tokenization", "template"):
        table.add_column(column, overflow="fold")
    for i, report in enumerate(reports):
        info = batch["agent_info"][i]
        table.add_row(
            str(i),
            str(info["num_turns"]),
            str(len(batch["tool_calls"][i])),
            _describe(report["retokenize"]),
            _describe(report["template"]),
        )
    console.print(table)
    for key, value in metrics.items():
        console.print(f"{key}: {value:.4g}")
    mismatch = (
        metrics["tokenization/retokenize_mismatch_rate"] > 0
        or metrics["tokenization/template_mismatch_rate"] > 0
    )
    if mismatch:
        console.print(
            "[yellow]drift found:[/yellow] a pipeline that decodes and re-encodes these "
            "trajectories (or re-renders the chat template) would train on other ids than "
            "the policy sampled; creditrl trains on the sampled ids."
        )
    return 1 if args.strict and mismatch else 0


def register(sub: Any) -> None:
    """Add ``check-tokenization`` to the CLI."""
    cmd = sub.add_parser(
        "check-tokenization", help="re-tokenization and chat-template drift checks (spec 004)"
    )
    cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    cmd.add_argument("--rows", type=int, default=8, help="prompts to roll out (default 8)")
    cmd.add_argument("--greedy", action="store_true", help="greedy decoding")
    cmd.add_argument("--demo", action="store_true", help="forced canonical + non-canonical case")
    cmd.add_argument("--strict", action="store_true", help="exit 1 on any mismatch")
    cmd.set_defaults(handler=run)
