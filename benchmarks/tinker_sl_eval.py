"""Before/after NLL of the cookbook's supervised recipe (``chat_sl``) on the same batches.

The recipe logs ``train_mean_nll`` of each batch before its own update, on a different batch
each step; this script scores the same batches with the base model (a fresh LoRA client: its
adapters start at zero) and with the recipe's final checkpoint, through the SDK against
``creditrl serve-tinker``. The batches are rebuilt exactly as the recipe built them (the same
builder, file, renderer, length cap, batch size and first-epoch shuffle)::

    TINKER_BASE_URL=http://127.0.0.1:8001 TINKER_API_KEY=tml-local \\
      python benchmarks/tinker_sl_eval.py LOG_PATH MODEL_DIR conversations.jsonl --batches 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path


def main() -> None:
    import tinker
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_path", type=Path)
    parser.add_argument("model")
    parser.add_argument("file")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--renderer", default="qwen3_instruct")
    args = parser.parse_args()
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model,
        renderer_name=args.renderer,
        max_length=args.max_length,
        batch_size=args.batch_size,
    )
    builder = FromConversationFileBuilder(common_config=common, file_path=args.file)
    built = builder()
    dataset = asyncio.run(built) if asyncio.iscoroutine(built) else built
    train = dataset[0]
    train.set_epoch(seed=0)  # the recipe's first epoch's order
    lines = (args.log_path / "checkpoints.jsonl").read_text(encoding="utf-8").splitlines()
    state = [json.loads(line) for line in lines if "state_path" in line][-1]["state_path"]
    service = tinker.ServiceClient()
    clients = {
        "base": service.create_lora_training_client(base_model=args.model, rank=32).result(),
        "final": service.create_training_client_from_state(state).result(),
    }
    totals = {name: [0.0, 0.0] for name in clients}
    for index in range(args.batches):
        data = train.get_batch(index)
        weight = sum(float(sum(d.loss_fn_inputs["weights"].tolist())) for d in data)
        for name, client in clients.items():
            loss = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
            totals[name][0] += loss
            totals[name][1] += weight
    service.close("success").result()
    for name, (loss, weight) in totals.items():
        print(f"{name}: mean NLL {loss / weight:.4f} over {args.batches} batches")


if __name__ == "__main__":
    main()
