"""How often the untrained embedded model writes the answer format, by prompt and temperature.

Run: .venv/bin/python benchmarks/format_probe.py [--prompts 16] [--few-shot 0,1,2] [--threads 2]

For each ``data.few_shot`` (worked examples before the question) it samples ``--prompts``
chain_sum training prompts x 4 at temperatures 0.7 and 1.0 and once greedily, and prints per
setting: answers with ``<answer>`` tags, correct answers (tagged or not) and the mean score of
the default scorer. A GRPO group learns the tags only if some of its samples carry them, so
the tagged share at the training temperature is what decides whether the format is learned.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

from creditrl.config.schema import DataConfig, RolloutConfig
from creditrl.data import build_datasets
from creditrl.models.embedded import embedded_model_dir
from creditrl.models.tokenizer import load_tokenizer
from creditrl.rewards.scorers import reasoning_gym_score
from creditrl.rollout import HFRolloutEngine


def probe(model, tokenizer, few_shot: int, prompts: int, temperature: float) -> dict:
    train, _ = build_datasets(DataConfig(few_shot=few_shot, val_size=0), tokenizer)
    n = 1 if temperature == 0 else 4
    batch = train.batch(list(range(prompts))).repeat(n)
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(temperature=temperature or 1.0))
    out = engine.generate(batch, greedy=temperature == 0)
    tagged = correct = score = 0.0
    for i in range(len(out)):
        length = int(out["response_mask"][i].sum())
        text = tokenizer.decode(out["responses"][i, :length], skip_special_tokens=True)
        result = reasoning_gym_score(
            out["data_source"][i], text, out["ground_truth"][i], out["extra_info"][i]
        )
        tagged += result["format_score"]
        correct += result["answer_score"] >= 1
        score += result["score"]
    return {
        "few_shot": few_shot,
        "temperature": temperature,
        "samples": len(out),
        "tagged": int(tagged),
        "correct": int(correct),
        "mean_score": round(score / len(out), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--few-shot", default="0,1,2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = embedded_model_dir()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for few_shot in (int(k) for k in args.few_shot.split(",")):
        for temperature in (0.0, 0.7, 1.0):
            print(json.dumps(probe(model, tokenizer, few_shot, args.prompts, temperature)))


if __name__ == "__main__":
    main()
